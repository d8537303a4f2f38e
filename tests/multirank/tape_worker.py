"""A user's own ``tf.GradientTape`` loop on :class:`hvdtrain.tensorflow.tape.TapeTrainer`, run by
tests/multirank/test_tape.py under ``horovodrun -np 2``.

``tape_worker.py OUT CONFIG [overrides...]``: ``hvdtrain train``'s driver, then the user loop in
its traced form (``@trainer.function``) and in its eager form, on the same model, data and
config; writes each one's parameters (``train-rank<r>.npz``, ``loop-rank<r>.npz``,
``eager-rank<r>.npz``) and the traced loop's position (``loop-rank<r>.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.config import load_config
from hvdtrain.data.digits import DigitsDataset
from hvdtrain.driver import train
from hvdtrain.tensorflow import MLP
from hvdtrain.tensorflow.tape import TapeTrainer


def user_loop(config: str, overrides: list[str], traced: bool = True) -> TapeTrainer:
    """The loop a Horovod user writes, on the API: set_epoch, a tape, apply_gradients; traced
    by ``@trainer.function`` (as ``@tf.function`` around ``DistributedGradientTape``) or eager."""
    trainer = TapeTrainer(config, overrides)
    dataset = DigitsDataset()
    model = MLP(hidden=[128]).build(dataset.spec())  # any built keras.Model; this one's is the trainer's
    model, _ = trainer.setup(model)
    split = dataset.train()
    batches = trainer.dataset(split.x, split.y)

    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, logits, from_logits=True))  # NaN for a rank's empty micro-batch: ignored
        trainer.apply_gradients(tape, loss)
        return loss

    step = trainer.function(train_step) if traced else train_step
    for epoch in trainer.epochs():
        batches.set_epoch(epoch)
        sums = {"loss": 0.0, "count": 0.0}
        for x, y in batches:
            loss = step(x, y)
            if len(y):
                sums["loss"] += float(loss) * len(y)
                sums["count"] += len(y)
        trainer.log(sums)  # averaged over the ranks, weighted by count
    trainer.close()
    return trainer


def save(out: Path, name: str, params: dict[str, np.ndarray], rank: int) -> None:
    # By position: Keras's names carry per-process counters (dense_1, dense_3, ...).
    np.savez(out / f"{name}-rank{rank}.npz", *params.values())


def main() -> None:
    out, config, *overrides = sys.argv[1:]
    out_dir = Path(out)
    result = train(load_config(config, [*overrides, f"log.dir={out_dir / 'train'}"]))
    assert result.engine is not None
    save(out_dir, "train", result.engine.parameters(), result.engine.rank)
    trainer = user_loop(config, [*overrides, f"log.dir={out_dir / 'loop'}"])
    save(out_dir, "loop", trainer.parameters(), trainer.rank)
    eager = user_loop(config, [*overrides, f"log.dir={out_dir / 'eager'}"], traced=False)
    save(out_dir, "eager", eager.parameters(), eager.rank)
    Path(out_dir, f"loop-rank{trainer.rank}.json").write_text(json.dumps(
        {"step": trainer.position.step, "epoch": trainer.position.epoch}))


if __name__ == "__main__":
    main()
