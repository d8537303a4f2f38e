"""Bad use of :class:`hvdtrain.tensorflow.fit.KerasFit` in one process: one-line refusals."""

from __future__ import annotations

import keras
import pytest

from hvdtrain.errors import HvdtrainError
from hvdtrain.tensorflow.fit import KerasFit
from tests.conftest import CONFIG, TF_CONFIG

QUIET = ["log.console=false", "log.wandb=disabled"]


def test_a_compression_fit_cannot_carry_is_refused(tmp_path):
    with pytest.raises(HvdtrainError, match=r"^comm.compression='topk': model.fit exchanges"):
        KerasFit(TF_CONFIG, [f"log.dir={tmp_path}", "comm.compression=topk", *QUIET])


def test_a_torch_config_is_refused():
    with pytest.raises(HvdtrainError, match=r"^framework='torch': KerasFit trains Keras models"):
        KerasFit(CONFIG)


def test_setup_of_an_uncompiled_model_is_a_one_line_error(tmp_path):
    run = KerasFit(TF_CONFIG, [f"log.dir={tmp_path}", *QUIET])
    try:
        model = keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(10)])
        with pytest.raises(HvdtrainError, match=r"compile the model first"):
            run.setup(model)
    finally:
        run.close()
