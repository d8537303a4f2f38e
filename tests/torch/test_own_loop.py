"""Bad use of :class:`hvdtrain.torch.Trainer` in one process (Horovod size 1): one-line errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hvdtrain.errors import HvdtrainError
from hvdtrain.torch import Trainer, launch
from tests.conftest import CONFIG

QUIET = ["log.console=false", "log.wandb=disabled"]


def trainer(tmp_path, *overrides: str) -> Trainer:
    return Trainer(CONFIG, [f"log.dir={tmp_path / 'run'}", *QUIET, *overrides])


def test_backward_before_setup_is_a_one_line_error(tmp_path):
    t = trainer(tmp_path)
    try:
        with pytest.raises(HvdtrainError, match=r"^trainer.backward\(\) before trainer.setup"):
            t.backward(torch.tensor(1.0, requires_grad=True))
    finally:
        t.close()


def test_resume_into_another_model_is_a_one_line_error(tmp_path):
    first = trainer(tmp_path)
    first.setup(nn.Linear(64, 10))
    first.save()
    first.close()
    second = trainer(tmp_path, "checkpoint.resume=auto")
    try:
        with pytest.raises(HvdtrainError) as info:
            second.setup(nn.Linear(64, 12))
        message = str(info.value)
        assert "step-00000000.ckpt does not fit the model" in message and "\n" not in message
    finally:
        second.close()


def test_elastic_is_refused(tmp_path):
    with pytest.raises(HvdtrainError, match=r"elastic.enabled=true: hvdtrain.torch.Trainer has no"):
        trainer(tmp_path, "elastic.enabled=true")


def test_launch_turns_errors_into_one_line_and_exit_2(capsys):
    def main() -> None:
        raise HvdtrainError("data.batch_size=0: must be at least 1")

    with pytest.raises(SystemExit) as info:
        launch(main)
    assert info.value.code == 2
    assert capsys.readouterr().err == "hvdtrain: error: data.batch_size=0: must be at least 1\n"
