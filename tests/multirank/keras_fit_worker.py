"""Keras 3 ``model.fit`` on :class:`hvdtrain.tensorflow.fit.KerasFit`, run by
tests/multirank/test_keras_fit.py under ``horovodrun -np 2``.

``worker.py OUT CONFIG [overrides...]`` trains digits with fit and writes each rank's weights
(``fit-rank<r>.npz``) and fit's history (``fit-rank<r>.json``); with
``HVDTRAIN_TEST_SIGNAL_AT=<step>`` each rank sends itself SIGUSR1 after that step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import keras
import numpy as np

from hvdtrain.data.digits import DigitsDataset
from hvdtrain.tensorflow.fit import KerasFit


class SignalAt(keras.callbacks.Callback):
    """Sends this rank SIGUSR1 after fit's global step ``step`` (a stop request, as Slurm's)."""

    def __init__(self, run: KerasFit, step: int) -> None:
        super().__init__()
        self.run, self.step = run, step

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.run.position.step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


def main() -> None:
    out, config, *overrides = sys.argv[1:]
    run = KerasFit(config, [*overrides, f"log.dir={Path(out) / 'fit'}"])
    model = keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=run.optimizer(), jit_compile=False, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    run.setup(model)
    split = DigitsDataset().train()
    callbacks = [*run.callbacks(), SignalAt(run, int(os.environ.get("HVDTRAIN_TEST_SIGNAL_AT", 0)))]
    data = run.dataset(split.x, split.y)
    history = model.fit(data, epochs=run.epochs, steps_per_epoch=run.steps_per_epoch,
                        initial_epoch=run.initial_epoch, callbacks=callbacks, verbose=0)
    rank = run.rank
    np.savez(Path(out) / f"fit-rank{rank}.npz", *model.get_weights())
    Path(out, f"fit-rank{rank}.json").write_text(json.dumps(
        {"history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
         "step": run.position.step, "epoch": run.position.epoch}))


if __name__ == "__main__":
    main()
