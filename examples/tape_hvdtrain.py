"""A TensorFlow `tf.GradientTape` loop as a Horovod user writes it: run it with
`horovodrun -np 2 python examples/tape_hvdtrain.py OUT_DIR [key=value ...]`.

An MLP on scikit-learn's digits (shipped with the package, no download). Each rank trains on its
share of each global batch; the step, decorated with `@trainer.function`, averages the gradients
and updates in one traced function, `trainer.setup` starts every rank from rank 0's state, and
rank 0 saves. This is examples/tape_horovod.py on hvdtrain
(`diff examples/tape_horovod.py examples/tape_hvdtrain.py`): hvdtrain's global batches, its
checkpoints (resume with checkpoint.resume=auto), stop signals and metric sinks.
"""

import json
import sys
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

from hvdtrain.tensorflow.tape import TapeTrainer


def digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits, pixels scaled to [0, 1]."""
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype("float32"), y.astype("int64")


def main(out: Path) -> None:
    trainer = TapeTrainer(None, ["train.epochs=3", f"log.dir={out}", *sys.argv[2:]])
    x, y = digits()
    data = trainer.dataset(x, y)
    model = keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(0.05 * trainer.size, momentum=0.9)
    model, optimizer = trainer.setup(model, optimizer)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @trainer.function  # the allreduce and the update are traced with the step
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        trainer.apply_gradients(tape, loss)
        return loss

    losses = []
    for epoch in trainer.epochs():
        data.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total, count = 0.0, 0
        for xb, yb in data:
            loss = train_step(xb, yb)
            if len(yb):
                total, count = total + float(loss) * len(yb), count + len(yb)
        losses.append(trainer.log({"loss": total, "count": count})["loss"])

    trainer.save()
    trainer.close()
    checksum = float(sum(np.abs(w).sum() for w in model.get_weights()))
    print(json.dumps({"rank": trainer.rank, "loss": losses, "checksum": checksum}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
