"""A Keras 3 `model.fit` script as a Horovod user writes it: run it with
`horovodrun -np 2 python examples/keras_horovod.py OUT_DIR`.

An MLP on scikit-learn's digits (shipped with the package, no download). Each rank fits its shard;
`hvd.DistributedOptimizer` averages the gradients, `BroadcastGlobalVariablesCallback` starts every
rank from rank 0's weights, `MetricAverageCallback` averages the epoch metrics, and only rank 0
saves. examples/keras_hvdtrain.py is the same script on hvdtrain
(`diff examples/keras_horovod.py examples/keras_hvdtrain.py`). Each rank's last line is a JSON
record of its final loss and a checksum of its weights.
"""

import json
import sys
from pathlib import Path

import horovod.tensorflow.keras as hvd
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
    # XLA cannot compile Horovod's ops (hvdtrain's build of Horovod has no XLA op file).
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback()]
    history = model.fit(data, epochs=3, callbacks=callbacks,
                        verbose=2 if hvd.rank() == 0 else 0)

    if hvd.rank() == 0:
        model.save_weights(out / "model.weights.h5")
    checksum = float(sum(np.abs(w).sum() for w in model.get_weights()))
    losses = [float(v) for v in history.history["loss"]]
    print(json.dumps({"rank": hvd.rank(), "loss": losses, "checksum": checksum}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
