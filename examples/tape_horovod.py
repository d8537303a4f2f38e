"""A TensorFlow `tf.GradientTape` loop as a Horovod user writes it: run it with
`horovodrun -np 2 python examples/tape_horovod.py OUT_DIR`.

An MLP on scikit-learn's digits (shipped with the package, no download). Each rank trains on its
shard; the `tf.function` step averages the gradients with `hvd.DistributedGradientTape`, a
broadcast after the first step starts every rank from rank 0's state, and only rank 0 saves.
examples/tape_hvdtrain.py is the same script on hvdtrain
(`diff examples/tape_horovod.py examples/tape_hvdtrain.py`). Each rank's last line is a JSON
record of its loss per epoch and a checksum of its weights.
"""

import json
import sys
from pathlib import Path

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits


def digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits, pixels scaled to [0, 1]."""
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype("float32"), y.astype("int64")


def main(out: Path) -> None:
    hvd.init()
    keras.utils.set_random_seed(hvd.rank())
    x, y = digits()
    data = tf.data.Dataset.from_tensor_slices((x, y)).shard(hvd.size(), hvd.rank())
    data = data.shuffle(2048, seed=0).batch(32)
    model = keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=False)  # XLA cannot compile Horovod's ops
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, [v.value for v in model.trainable_variables])
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    losses, first = [], True
    for _ in range(3):
        total, count = 0.0, 0
        for xb, yb in data:
            loss = train_step(xb, yb)
            if first:  # the optimizer's variables exist after its first step
                hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
                hvd.broadcast_variables([v.value for v in optimizer.variables], root_rank=0)
                first = False
            total, count = total + float(loss) * len(yb), count + len(yb)
        sums = hvd.allreduce(tf.constant([total, count], tf.float64), op=hvd.Sum).numpy()
        losses.append(float(sums[0] / sums[1]))
        if hvd.rank() == 0:
            print(f"loss {losses[-1]:.4f}", flush=True)

    if hvd.rank() == 0:
        model.save_weights(out / "model.weights.h5")
    checksum = float(sum(np.abs(w).sum() for w in model.get_weights()))
    print(json.dumps({"rank": hvd.rank(), "loss": losses, "checksum": checksum}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
