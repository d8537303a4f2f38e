"""Elastic mode with data on disk loaded by worker processes: a rank is SIGKILLed mid-epoch and
every sample is still trained on exactly once per epoch, and the learning rate follows the world
size (``elastic.on_resize=scale_lr``)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.data.digits import DigitsDataset
from tests.conftest import read_jsonl
from tests.multirank.test_elastic import check_every_index_once_per_epoch, check_recovery, elastic_job, finish
from tests.multirank.test_stop_resume import wait_for_records


def digits_as_npy(root: Path) -> Path:
    """The digits, as ``npy`` files: the same samples, read from disk through memory maps."""
    root.mkdir(parents=True)
    data = DigitsDataset()
    for split, source in (("train", data.train()), ("test", data.test())):
        np.save(root / f"{split}_x.npy", source.x)
        np.save(root / f"{split}_y.npy", source.y)
    return root


def kill_training_rank(rank: int, marker: str) -> float:
    """SIGKILLs the training process of ``rank`` (not one of its loader workers, which share its
    command line and environment: the one whose parent is not one of them); returns when."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
            status = (proc / "status").read_text()
        except (OSError, ValueError):
            continue
        if marker.encode() in cmdline and f"HOROVOD_RANK={rank}".encode() in environ:
            found[int(proc.name)] = int(status.split("PPid:")[1].split()[0])
    pids = [pid for pid, parent in found.items() if parent not in found]
    assert len(pids) == 1, found
    os.kill(pids[0], signal.SIGKILL)
    return time.time()


@pytest.mark.timeout(900)
def test_exactly_once_across_a_resize_with_loader_workers(tmp_path):
    npy, run = digits_as_npy(tmp_path / "npy"), tmp_path / "run"
    # A constant rate, so that each record's is the one-rank rate (0.05) times the world size.
    proc = elastic_job("torch", run, "discover_hosts_static.sh", 2, "train.epochs=12",
                       "data.name=npy", f"data.options={{root: {npy}}}", "data.workers=2",
                       "optim.schedule=constant", "optim.warmup_steps=0")
    try:
        wait_for_records(run / "metrics.jsonl", 8, timeout=400)  # step 35: mid-epoch 2
        killed_at = kill_training_rank(1, str(run))
        finish(proc, run)
    finally:
        proc.kill()
    reset = check_recovery(run, killed_at)
    records = read_jsonl(run / "metrics.jsonl")
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps))  # the records of rolled-back steps were dropped
    lrs = {r["step"]: r["lr"] for r in records if "lr" in r}
    assert min(lrs) <= reset["step"] < max(lrs)  # records at both sizes
    for step, lr in lrs.items():  # halved from the reset on (the step it went back to: 2 ranks)
        assert lr == pytest.approx(0.05 * (2 if step <= reset["step"] else 1)), (step, lr, reset)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["elastic"]["resets"] == 1
    # at the constant rate one run reached 0.967; the bar leaves room for where the kill lands
    assert summary["final"]["eval_accuracy"] >= 0.93
    check_every_index_once_per_epoch(run, 12)
