""":class:`hvdtrain.torch.Trainer` in one process (Horovod size 1): bad use is one line; an
elastic loop records each sample once an epoch."""

from __future__ import annotations

import numpy as np
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


def test_an_elastic_loop_sees_each_sample_once_an_epoch(tmp_path):
    # One process: Horovod's elastic runner with no resets (the kill is the multirank test's).
    from tests.multirank import own_loop_elastic_worker
    run = tmp_path / "run"
    done = own_loop_elastic_worker.main([f"log.dir={run}", *QUIET, "train.epochs=1",
                                         "elastic.enabled=true", "elastic.commit_every=5",
                                         "elastic.record_indices=true"], pause=0.0)
    # Commits at the step boundaries 5, 10, ..., 40; the steps after the last are gathered at
    # the end.
    assert done.position.step == 45 and done.elastic_state.commits == 8
    indices = np.load(run / "indices" / "epoch-0000.npy")
    assert np.array_equal(np.sort(indices), np.arange(1437))


def test_elastic_bad_use_is_one_line(tmp_path):
    with pytest.raises(HvdtrainError, match=r"^elastic.on_resize='keep_global_batch': "
                       r"hvdtrain.torch.Trainer's elastic mode keeps the per-rank batch"):
        trainer(tmp_path, "elastic.enabled=true", "elastic.on_resize=keep_global_batch")
    t = trainer(tmp_path, "elastic.enabled=true")
    try:
        model, _ = t.setup(nn.Linear(64, 10))
        loss = model(torch.zeros(2, 64)).sum()
        with pytest.raises(HvdtrainError, match=r"^elastic.enabled=true: trainer.backward\(\) "
                           r"outside the training function; decorate .* with @trainer.elastic"):
            t.backward(loss)
        with pytest.raises(HvdtrainError, match=r"^elastic.enabled=true: trainer.backward\(\) "
                           r"on a batch that is not from the trainer's loader"):
            t.elastic(lambda: t.backward(loss))()
    finally:
        t.close()


def test_launch_turns_errors_into_one_line_and_exit_2(capsys):
    def main() -> None:
        raise HvdtrainError("data.batch_size=0: must be at least 1")

    with pytest.raises(SystemExit) as info:
        launch(main)
    assert info.value.code == 2
    assert capsys.readouterr().err == "hvdtrain: error: data.batch_size=0: must be at least 1\n"
