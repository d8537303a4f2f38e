"""Keras 3 ``model.fit`` on :class:`hvdtrain.tensorflow.fit.KerasFit`, run by
tests/multirank/test_keras_fit.py under ``horovodrun -np 2``.

``worker.py OUT CONFIG [overrides...]`` trains digits with fit and writes each rank's weights
(``fit-rank<r>.npz``) and fit's history (``fit-rank<r>.json``); with
``HVDTRAIN_TEST_SIGNAL_AT=<step>`` each rank sends itself SIGUSR1 after that step. With
``HVDTRAIN_TEST_TRAIN_TOO=1`` it first runs ``hvdtrain train`` on the same config (its
parameters in ``train-rank<r>.npz``) and fits the trainer's own model.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import keras
import numpy as np

from hvdtrain.config import load_config
from hvdtrain.data.digits import DigitsDataset
from hvdtrain.driver import train
from hvdtrain.tensorflow import MLP
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
    train_too = os.environ.get("HVDTRAIN_TEST_TRAIN_TOO") == "1"
    if train_too:
        result = train(load_config(config, [*overrides, f"log.dir={Path(out) / 'train'}"]))
        assert result.engine is not None
        np.savez(Path(out) / f"train-rank{result.engine.rank}.npz",
                 *result.engine.parameters().values())
    run = KerasFit(config, [*overrides, f"log.dir={Path(out) / 'fit'}"])
    if train_too:  # the trainer's model, built after the KerasFit seeded Keras as the trainer does
        model = MLP(hidden=[128]).build(DigitsDataset().spec())
    else:
        model = keras.Sequential([keras.Input(shape=(64,)),
                                  keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dense(10)])
    model.compile(optimizer=run.optimizer(), jit_compile=False, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    run.setup(model)
    if train_too:  # rank 0's start, to tell that fit trained
        np.savez(Path(out) / f"init-rank{run.rank}.npz", *model.get_weights())
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
