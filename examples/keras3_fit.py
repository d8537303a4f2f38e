"""A Keras 3 `model.fit` script on Horovod's Keras API: run it with `horovodrun -np 2 python
examples/keras3_fit.py`.

Each rank trains on its shard of scikit-learn's digits (shipped with the package, no download);
`hvd.DistributedOptimizer` averages the gradients, `BroadcastGlobalVariablesCallback` starts every
rank from rank 0's weights and `MetricAverageCallback` averages the epoch metrics. The last line
printed by each rank is a JSON record of its final loss and a checksum of its weights, so a test
can check that the ranks agree.
"""

import json
import sys

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf
from horovod.tensorflow import SyncBatchNormalization
from sklearn.datasets import load_digits


def shard(rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's share of the digits, scaled to [0, 1]."""
    x, y = load_digits(return_X_y=True)
    return (x[rank::size] / 16.0).astype("float32"), y[rank::size].astype("int64")


def build_model() -> tf.keras.Model:
    """A small classifier with a SyncBatchNormalization layer (statistics over all ranks)."""
    return tf.keras.Sequential([
        tf.keras.Input(shape=(64,)),
        tf.keras.layers.Dense(64, activation="relu"),
        SyncBatchNormalization(),
        tf.keras.layers.Dense(10),
    ])


def main(epochs: int = 3) -> None:
    """Trains for `epochs` epochs and prints the rank's result as one JSON line."""
    hvd.init()
    tf.keras.utils.set_random_seed(hvd.rank())  # different starts: the broadcast must align them
    x, y = shard(hvd.rank(), hvd.size())
    model = build_model()
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9))
    # XLA cannot compile Horovod's ops (hvdtrain's build has no XLA op file).
    model.compile(optimizer=optimizer, jit_compile=False, metrics=["accuracy"],
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback()]
    history = model.fit(x, y, batch_size=32, epochs=epochs, callbacks=callbacks,
                        verbose=2 if hvd.rank() == 0 else 0)
    checksum = float(sum(np.abs(w).sum() for w in model.get_weights()))
    print(json.dumps({"rank": hvd.rank(), "size": hvd.size(),
                      "loss": [float(v) for v in history.history["loss"]],
                      "accuracy": [float(v) for v in history.history["accuracy"]],
                      "checksum": checksum}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
