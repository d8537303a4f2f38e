"""Elastic mode in your own PyTorch loop (``@trainer.elastic``, docs/own-loop.md) with real
workers: one is killed with SIGKILL mid-run; the survivor continues from the last commit at one
rank, and every sample is still trained on exactly once an epoch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BIN, ROOT, read_jsonl, run_env
from tests.multirank.test_elastic import (
    COMMIT_EVERY,
    DIGITS_TRAIN,
    check_every_index_once_per_epoch,
    check_recovery,
    finish,
    kill_rank_one,
)
from tests.multirank.test_stop_resume import wait_for_records

WORKER = str(Path(__file__).with_name("own_loop_elastic_worker.py"))
EPOCHS = 8


def elastic_loop(run: Path) -> subprocess.Popen:
    """Starts the user loop under elastic ``horovodrun`` (1 to 2 workers, two host names)."""
    cmd = [str(BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
           "--network-interfaces", "lo", "--host-discovery-script",
           str(ROOT / "scripts" / "discover_hosts_static.sh"), sys.executable, WORKER,
           "elastic.enabled=true", f"elastic.commit_every={COMMIT_EVERY}",
           "elastic.record_indices=true", f"train.epochs={EPOCHS}", "log.wandb=disabled",
           "log.console=false", f"log.dir={run}"]
    run.parent.mkdir(parents=True, exist_ok=True)
    with (run.parent / "job.log").open("w") as log:  # a file: a full pipe would block the job
        return subprocess.Popen(cmd, env=run_env(), stdout=log, stderr=subprocess.STDOUT,
                                text=True)


@pytest.mark.long
@pytest.mark.timeout(900)
def test_own_loop_survives_a_worker_killed_mid_run(tmp_path):
    run = tmp_path / "run"
    proc = elastic_loop(run)
    try:
        wait_for_records(run / "metrics.jsonl", 2, timeout=400)  # two epochs of 23 steps done
        killed_at = kill_rank_one(run)
        finish(proc, run)
    finally:
        proc.kill()
    reset = check_recovery(run, killed_at)
    assert reset["world_size"] == 1 and reset["step"] >= 40
    done = json.loads((run / "loop.json").read_text())
    assert done["size"] == 1 and done["epoch"] == EPOCHS
    assert done["samples"] == EPOCHS * DIGITS_TRAIN
    records = read_jsonl(run / "metrics.jsonl")
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)) and len(steps) == EPOCHS  # one record an epoch
    assert records[-1]["loss"] < records[0]["loss"]
    check_every_index_once_per_epoch(run, EPOCHS)
