""":class:`hvdtrain.tensorflow.tape.TapeTrainer` in one process: a resume from a mid-epoch
checkpoint ends bit-identical to the uninterrupted loop; the traced form (``@trainer.function``)
equals the eager one; bad use is one line."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.data.digits import DigitsDataset
from hvdtrain.errors import HvdtrainError
from hvdtrain.tensorflow import MLP
from hvdtrain.tensorflow.tape import TapeTrainer
from tests.conftest import CONFIG, TF_CONFIG

QUIET = ["log.console=false", "log.wandb=disabled"]


def loop(trainer: TapeTrainer, resume_from: Path | None = None,
         traced: bool = True) -> dict[str, np.ndarray]:
    dataset = DigitsDataset()
    model, _ = trainer.setup(MLP(hidden=[128]).build(dataset.spec()))
    if resume_from is not None:
        assert trainer.load(resume_from)
    split = dataset.train()
    batches = trainer.dataset(split.x, split.y)

    def train_step(x: tf.Tensor, y: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, model(x, training=True), from_logits=True))
        trainer.apply_gradients(tape, loss)

    step = trainer.function(train_step) if traced else train_step
    for epoch in trainer.epochs():
        batches.set_epoch(epoch)
        for x, y in batches:
            step(x, y)
    trainer.close()
    return trainer.parameters()


def test_a_resume_mid_epoch_is_bit_identical(tmp_path):
    # 1,437 samples in batches of 32: 45 steps an epoch; the checkpoint at step 30 is mid-epoch.
    run = ["train.epochs=2", "checkpoint.every_steps=30", *QUIET]
    whole = loop(TapeTrainer(TF_CONFIG, [*run, f"log.dir={tmp_path / 'whole'}"]))
    saved = sorted(p.name for p in (tmp_path / "whole" / "checkpoints").glob("*.ckpt"))
    assert saved == ["step-00000030.ckpt", "step-00000060.ckpt", "step-00000090.ckpt"]
    again = TapeTrainer(TF_CONFIG, [*run, f"log.dir={tmp_path / 'again'}"])
    resumed = loop(again, tmp_path / "whole" / "checkpoints" / "step-00000030.ckpt")
    assert again.position.step == 90
    assert sorted(whole) == sorted(resumed) and len(whole) == 4
    for name, value in whole.items():
        assert np.array_equal(resumed[name], value), name


@pytest.mark.parametrize("run", [
    # two micro-batches a step, the last step's second one empty: the accumulating trace, then
    # the fused allreduce and update; topk: the exchange runs eagerly after the traced step
    ["train.backward_passes_per_step=2", "data.batch_size=16"], ["comm.compression=topk"]])
def test_the_traced_form_equals_the_eager_one(tmp_path, run):
    run = [*run, "train.epochs=1", *QUIET]
    eager = loop(TapeTrainer(TF_CONFIG, [*run, f"log.dir={tmp_path / 'eager'}"]), traced=False)
    traced = TapeTrainer(TF_CONFIG, [*run, f"log.dir={tmp_path / 'traced'}"])
    same = loop(traced)
    assert traced.position.step == 45 and sorted(same) == sorted(eager)
    for name, value in eager.items():
        assert np.array_equal(same[name], value), name


def test_apply_gradients_in_a_plain_tf_function_or_twice_is_one_line(tmp_path):
    trainer = TapeTrainer(TF_CONFIG, [f"log.dir={tmp_path}", *QUIET])
    try:
        model, _ = trainer.setup(MLP(hidden=[4]).build(DigitsDataset().spec()))
        x = tf.zeros([2, 64])

        def step(times: int) -> None:
            for _ in range(times):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(model(x))
                trainer.apply_gradients(tape, loss)

        with pytest.raises(HvdtrainError, match=r"^trainer.apply_gradients\(\) inside a "
                           r"tf.function: decorate the step with @trainer.function instead"):
            tf.function(lambda: step(1))()
        with pytest.raises(HvdtrainError, match=r"^a @trainer.function step called "
                           r"trainer.apply_gradients\(\) 2 times: call it once per step"):
            trainer.function(lambda: step(2))()
    finally:
        trainer.close()


def test_apply_gradients_before_setup_and_a_torch_config_are_one_line(tmp_path):
    with pytest.raises(HvdtrainError, match=r"^framework='torch': TapeTrainer trains Keras"):
        TapeTrainer(CONFIG)
    trainer = TapeTrainer(TF_CONFIG, [f"log.dir={tmp_path}", *QUIET])
    try:
        with pytest.raises(HvdtrainError, match=r"apply_gradients\(\) before trainer.setup"):
            trainer.apply_gradients(tf.GradientTape(), tf.constant(0.0))
    finally:
        trainer.close()

