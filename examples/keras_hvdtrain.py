"""A Keras 3 `model.fit` script as a Horovod user writes it: run it with
`horovodrun -np 2 python examples/keras_hvdtrain.py OUT_DIR [key=value ...]`.

An MLP on scikit-learn's digits (shipped with the package, no download). Each rank fits its shard;
`hvd.DistributedOptimizer` averages the gradients, `run.setup` starts every rank from rank 0's
weights, `MetricAverageCallback` averages the epoch metrics, and only rank 0 saves. This is
examples/keras_horovod.py on hvdtrain (`diff examples/keras_horovod.py examples/keras_hvdtrain.py`):
hvdtrain's global batches, its checkpoints (resume with checkpoint.resume=auto), stop signals and
metric sinks.
"""

import json
import sys
from pathlib import Path

import keras
import numpy as np
from sklearn.datasets import load_digits

from hvdtrain.tensorflow.fit import KerasFit


def digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits, pixels scaled to [0, 1]."""
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype("float32"), y.astype("int64")


def main(out: Path) -> None:
    run = KerasFit(None, ["train.epochs=3", f"log.dir={out}", *sys.argv[2:]])
    x, y = digits()
    data = run.dataset(x, y)
    model = keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(0.05 * run.size, momentum=0.9)
    # XLA cannot compile Horovod's ops (hvdtrain's build of Horovod has no XLA op file).
    model.compile(optimizer=run.optimizer(optimizer), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    run.setup(model)
    history = model.fit(data, epochs=run.epochs, callbacks=run.callbacks(),
                        initial_epoch=run.initial_epoch, steps_per_epoch=run.steps_per_epoch,
                        verbose=2 if run.rank == 0 else 0)

    checksum = float(sum(np.abs(w).sum() for w in model.get_weights()))
    losses = [float(v) for v in history.history["loss"]]
    print(json.dumps({"rank": run.rank, "loss": losses, "checksum": checksum}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
