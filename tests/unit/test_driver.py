"""The run driver, session, loop and checkpoint policy end to end on the NumPy engine
(:mod:`tests.unit.numpy_world`): resuming and stopping, with no framework."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.driver import train
from hvdtrain.loop import Callback, Stopped
from tests.conftest import CONFIG, quiet_config
from tests.unit.numpy_world import NumpyEngine

STEPS = 9
# Digits' 1,437 training samples at 256 a step: 6 steps an epoch, the last one short (157), so
# that the 9 steps cross an epoch boundary; two micro-batches a step, and random-k with its step
# count and error-feedback residuals, so that a checkpoint carries compression state too (one
# dense step: the default dense start, at least comm.dense_min_steps, would average all 9 dense;
# a rule's own comm.dense_steps comes later and wins).
OVERRIDES = ("data.batch_size=128", "train.backward_passes_per_step=2", "comm.compression=randomk",
             "comm.min_size=0", "comm.ratio=0.2", f"train.max_steps={STEPS}", "log.every_steps=1",
             "optim.warmup_steps=2", "log.tensorboard=false", "comm.dense_steps=1")


def run(tmp_path: Path, *overrides: str, callbacks=()):
    cfg = quiet_config(CONFIG, tmp_path, *OVERRIDES, *overrides)
    return train(cfg, callbacks, engine_factory=NumpyEngine)


# Update rules whose state (velocities, momentum, frozen variance, warm-up position) a resume
# must restore: random-k under DGC (on request, with SGD momentum), top-k with DGC's clipping
# and density warm-up, and top-k / qsgd compressing AdamW's momentum after a 3-step warm-up.
RULES = {
    "dgc-randomk": ("comm.momentum_correction=true",),
    "dgc-topk-warmup-clip": ("comm.compression=topk", "comm.momentum_correction=true",
                             "comm.sparsity_warmup_steps=6",
                             "comm.clip_norm=0.5"),
    "adamw-topk": ("comm.compression=topk", "optim.name=adamw", "optim.lr=0.01",
                   "optim.weight_decay=0.01", "comm.dense_steps=3",
                   "comm.compress_momentum=true"),
    # comm.ratio back to its default: qsgd does not read it, and a key that does nothing is refused.
    "adam-qsgd": ("comm.compression=qsgd", "comm.ratio=0.01", "optim.name=adam", "optim.lr=0.01",
                  "comm.dense_steps=3", "comm.compress_momentum=true"),
}


@pytest.mark.parametrize("rule", RULES)
def test_a_resume_at_every_step_boundary_continues_at_the_same_position(tmp_path, rule):
    whole = run(tmp_path / "whole", "checkpoint.every_steps=1", f"checkpoint.keep={STEPS}",
                *RULES[rule])
    assert whole.engine.exchange.rule.updates
    expected = whole.engine.parameters()
    assert whole.summary["steps"] == STEPS and whole.summary["epochs"] == 1
    for k in range(1, STEPS):
        checkpoint = whole.run_dir / "checkpoints" / f"step-{k:08d}.ckpt"
        resumed = run(tmp_path / f"from{k}", f"checkpoint.resume={checkpoint}", *RULES[rule])
        got = resumed.engine.parameters()
        for name, value in expected.items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"resumed at step {k}: {name}")
        assert {key: resumed.summary[key] for key in ("steps", "epochs")} == \
            {key: whole.summary[key] for key in ("steps", "epochs")}
        # The samples of the steps after the checkpoint, and no others.
        assert resumed.summary["samples"] == whole.summary["samples"]
        assert resumed.summary["final"] == pytest.approx(whole.summary["final"], rel=1e-6)


class SignalAt(Callback):
    """Sends this process SIGUSR1 (as Slurm does before a preemption) before step ``step + 1``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_start(self, step: int) -> None:
        if step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


@pytest.mark.parametrize("k", [1, 4, 6])
def test_a_stop_request_at_step_k_checkpoints_there_and_the_rerun_finishes_the_same(tmp_path, k):
    whole = run(tmp_path / "whole")
    with pytest.raises(Stopped) as stopped:
        run(tmp_path / "stopped", callbacks=[SignalAt(k - 1)])
    # The request rides on the metrics sum started after step k, which inside an epoch completes
    # after the next step (it overlaps that step's work); an epoch's last step waits for its sum.
    # Every rank stops at the same step, after a checkpoint of that step.
    stop = k if k % 6 == 0 else k + 1
    assert stopped.value.step == stop
    assert stopped.value.checkpoint == tmp_path / "stopped" / "run" / "checkpoints" / \
        f"step-{stop:08d}.ckpt"
    assert stopped.value.checkpoint.is_file()
    rerun = run(tmp_path / "stopped", "checkpoint.resume=auto")
    for name, value in whole.engine.parameters().items():
        np.testing.assert_array_equal(rerun.engine.parameters()[name], value, err_msg=name)
