"""A user's own loop on :class:`hvdtrain.torch.Trainer` at two ranks (docs/own-loop.md): it ends with
the parameters ``hvdtrain train`` reaches on the same model, data and config, and a stop by signal
plus a resume ends bit-identical to the uninterrupted loop."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import CONFIG, horovodrun

WORKER = str(Path(__file__).with_name("own_loop_worker.py"))
# Digits' 1,437 training samples in global batches of 2 ranks x 16 x 2 micro-batches: each epoch's
# last step holds 29 samples, so its second micro-batch is empty on both ranks and the first
# splits 15/14 (the loss weighting and the empty batch both count).
RUN = ["train.epochs=2", "train.backward_passes_per_step=2", "data.batch_size=16",
       "log.every_steps=4", "log.console=false", "log.wandb=disabled"]


def launch(out: Path, mode: str, *overrides: str, env: dict[str, str] | None = None):
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, WORKER, str(out), str(CONFIG), mode, *RUN, *overrides]
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        return horovodrun(2, "gloo", argv, timeout=600)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def params(out: Path, name: str, rank: int) -> dict[str, np.ndarray]:
    with np.load(out / f"{name}-rank{rank}.npz") as npz:
        return dict(npz)


@pytest.fixture(scope="module")
def equiv(tmp_path_factory) -> Path:
    """``hvdtrain train``'s driver, then the user loop, in one launch at two ranks."""
    out = tmp_path_factory.mktemp("own-loop-equiv")
    proc = launch(out, "equiv")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_user_loop_ends_with_the_parameters_of_hvdtrain_train(equiv):
    for rank in (0, 1):
        trained, looped = params(equiv, "train", rank), params(equiv, "loop", rank)
        assert sorted(trained) == sorted(looped) == ["1.bias", "1.weight", "3.bias", "3.weight"]
        for name, value in trained.items():
            # Same kernels in the same order: equal up to the loss's reduction (sum x weight in
            # the trainer, mean x weight here), far inside the margin.
            np.testing.assert_allclose(looped[name], value, rtol=0, atol=1e-5, err_msg=name)
    init_moved = np.abs(params(equiv, "loop", 0)["3.weight"]).max()
    assert init_moved > 0.3  # it trained (initial weights are below 1/sqrt(128) ~ 0.09)
    done = json.loads((equiv / "loop-rank0.json").read_text())
    assert done == {"counter": 46, "step": 46, "epoch": 2}  # 2 epochs of 23 steps
    records = [json.loads(line) for line in (equiv / "loop" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [23, 46] and records[1]["loss"] < records[0]["loss"]


def test_stop_by_signal_and_resume_is_bit_identical(equiv, tmp_path):
    # Both ranks signal themselves after step 10; the sum started at the log interval (step 12)
    # rides beside step 13's gradients, so both checkpoint after step 13 and exit 75; the resume
    # continues from there.
    stopped = launch(tmp_path, "loop", env={"HVDTRAIN_TEST_SIGNAL_AT": "10"})
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode != 0, output[-3000:]  # horovodrun reports exit 75 as a failure
    assert "Exit code: 75" in output, output[-3000:]
    stops = re.findall(r"\[(\d)\]<stderr>:hvdtrain: stopped on request at step (\d+)", output)
    assert sorted(stops) == [("0", "13"), ("1", "13")], output[-3000:]
    assert [p.name for p in (tmp_path / "loop" / "checkpoints").glob("*.ckpt")] == \
        ["step-00000013.ckpt"]
    resumed = launch(tmp_path, "loop", "checkpoint.resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    for rank in (0, 1):
        whole, again = params(equiv, "loop", rank), params(tmp_path, "loop", rank)
        for name, value in whole.items():
            assert np.array_equal(again[name], value), f"rank {rank} {name} differs"
        # The user's object resumed too: it counted every step once.
        assert json.loads((tmp_path / f"loop-rank{rank}.json").read_text())["counter"] == 46


@pytest.mark.long
@pytest.mark.parametrize("method", ["topk", "powersgd"])
def test_user_loop_equals_hvdtrain_train_with_compression(tmp_path, method):
    proc = launch(tmp_path, "equiv", f"comm.compression={method}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        trained, looped = params(tmp_path, "train", rank), params(tmp_path, "loop", rank)
        for name, value in trained.items():
            np.testing.assert_allclose(looped[name], value, rtol=0, atol=1e-5, err_msg=name)
