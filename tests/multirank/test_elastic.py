"""Elastic mode with real workers: one is killed with SIGKILL mid-epoch, and one joins through the
hosts file. Two hosts on one machine: ``localhost`` and ``127.0.0.1`` (elastic Horovod needs two
hosts to start unless it is given the network interface)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import BIN, ROOT, read_jsonl, run_env
from tests.multirank.conftest import CONFIGS
from tests.multirank.test_stop_resume import pid_of_rank, wait_for_records

COMMIT_EVERY = 10
DIGITS_TRAIN = 1437


def elastic_job(framework: str, run: Path, hosts: str, np_: int, *overrides: str,
                env: dict[str, str] | None = None, max_np: int = 2) -> subprocess.Popen:
    """Starts ``horovodrun`` in elastic mode (1 to ``max_np`` workers) with a host-discovery
    script."""
    # One host alone does not start without naming the interface.
    cmd = [str(BIN / "horovodrun"), "-np", str(np_), "--min-np", "1", "--max-np", str(max_np),
           "--network-interfaces", "lo", "--host-discovery-script", str(ROOT / "scripts" / hosts),
           str(BIN / "hvdtrain"), "train", str(CONFIGS[framework]), "elastic.enabled=true",
           f"elastic.commit_every={COMMIT_EVERY}", "elastic.record_indices=true",
           "log.every_steps=5", "log.wandb=disabled", "log.console=false", f"log.dir={run}",
           *overrides]
    run.parent.mkdir(parents=True, exist_ok=True)
    with (run.parent / "job.log").open("w") as log:  # a file: a full pipe would block the job
        return subprocess.Popen(cmd, env={**run_env(), **(env or {})}, stdout=log,
                                stderr=subprocess.STDOUT, text=True)


def wait_for_event(run: Path, world_size: int, timeout: float = 240) -> dict:
    """Waits for the elastic event that brought the job to ``world_size`` workers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = run / "elastic.jsonl"
        events = read_jsonl(path) if path.exists() else []
        for event in events[1:]:
            if event["event"] == "reset" and event["world_size"] == world_size:
                return event
        time.sleep(0.2)
    raise AssertionError(f"no reset to {world_size} workers in {run / 'elastic.jsonl'}")


def kill_rank_one(run: Path) -> float:
    """SIGKILLs the worker of rank 1; returns when."""
    pid = pid_of_rank(1, str(run))
    os.kill(pid, signal.SIGKILL)
    return time.time()


def finish(proc: subprocess.Popen, run: Path, timeout: float = 400) -> None:
    proc.wait(timeout=timeout)
    assert proc.returncode == 0, (run.parent / "job.log").read_text()[-4000:]


def check_every_index_once_per_epoch(run: Path, epochs: int) -> None:
    files = sorted((run / "indices").glob("epoch-*.npy"))
    assert len(files) == epochs
    for path in files:
        indices = np.load(path)
        assert len(indices) == DIGITS_TRAIN, path.name  # none repeated ...
        assert np.array_equal(np.sort(indices), np.arange(DIGITS_TRAIN)), path.name  # ... none lost


def check_recovery(run: Path, killed_at: float) -> dict:
    """The reset after the kill: back to one worker, at most COMMIT_EVERY steps lost."""
    reset = wait_for_event(run, 1, timeout=5)
    assert 0 <= reset["lost_steps"] <= COMMIT_EVERY
    assert reset["step"] % COMMIT_EVERY == 0  # a commit point: every COMMIT_EVERY steps from 0
    assert reset["time"] - killed_at < 30
    return reset


# `long` (66 s in make test): make test has a PyTorch worker rejoining through the hosts file
# after a node was lost (tests/cluster/test_elastic_nodes.py), one SIGKILLed mid-epoch with the
# learning rate halved (test_data_elastic.py), and the rate at every resize in the core's loop
# (tests/unit/test_loop.py).
@pytest.mark.long
@pytest.mark.timeout(900)
def test_torch_worker_joins_through_the_hosts_file_then_one_is_killed(tmp_path):
    """Scale-up then scale-down in one job: 1 worker, a host added to the hosts file joins (the
    learning rate doubles), then that worker is SIGKILLed mid-epoch (it halves again)."""
    run, hosts = tmp_path / "run", tmp_path / "hosts.txt"
    hosts.write_text("localhost:1\n")
    proc = elastic_job("torch", run, "discover_hosts_file.sh", 1, "train.epochs=20",
                       "optim.schedule=constant", "optim.warmup_steps=0",
                       "model.name=tests.multirank.elastic_models:PacedMLP",
                       "model.options={hidden: [128], pause: 0.05}",
                       env={"HVDTRAIN_HOSTS_FILE": str(hosts)})
    try:
        wait_for_records(run / "metrics.jsonl", 3, timeout=600)
        hosts.write_text("localhost:1\n127.0.0.1:1\n")
        joined = wait_for_event(run, 2)
        wait_for_records(run / "metrics.jsonl", len(read_jsonl(run / "metrics.jsonl")) + 4)
        killed_at = kill_rank_one(run)
        finish(proc, run)
    finally:
        proc.kill()
    assert joined["lost_steps"] == 0  # a join interrupts at a commit: nothing to redo
    reset = check_recovery(run, killed_at)
    lrs = {r["step"]: r["lr"] for r in read_jsonl(run / "metrics.jsonl")}
    for step, lr in lrs.items():
        size = 2 if joined["step"] < step <= reset["step"] else 1
        assert lr == pytest.approx(0.05 * size), (step, lr, joined, reset)
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl")]
    assert steps == sorted(set(steps))  # the records of rolled-back steps were dropped
    summary = json.loads((run / "summary.json").read_text())
    assert summary["elastic"]["resets"] == 2 and summary["world_size"] == 1
    assert summary["samples"] == 20 * DIGITS_TRAIN
    assert summary["final"]["eval_accuracy"] >= 0.95
    check_every_index_once_per_epoch(run, 20)


# `long` (13 s in make test): make test has TensorFlow's lost worker twice in
# test_shard_elastic.py, whose TensorFlow row runs the ring (shard.stage=0) and stage 3 with a
# worker SIGKILLed mid-epoch: one reset from 3 workers to 2, back to the commit before the loss,
# every sample once an epoch, and the stage-3 parameters equal to the ring's.
@pytest.mark.long
@pytest.mark.timeout(900)
def test_tensorflow_survives_a_worker_killed_mid_epoch(tmp_path):
    run = tmp_path / "run"
    proc = elastic_job("tensorflow", run, "discover_hosts_static.sh", 2, "train.epochs=12")
    try:
        wait_for_records(run / "metrics.jsonl", 8, timeout=400)  # step 35: mid-epoch 2
        killed_at = kill_rank_one(run)
        finish(proc, run)
    finally:
        proc.kill()
    check_recovery(run, killed_at)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["elastic"]["resets"] == 1
    assert summary["samples"] == 12 * DIGITS_TRAIN
    assert summary["final"]["eval_accuracy"] >= 0.95
    check_every_index_once_per_epoch(run, 12)
