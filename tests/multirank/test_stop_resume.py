"""A stop signal to one rank stops both at the same step; the run resumes at another world size."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import BIN, CONFIG, run_env
from tests.multirank.conftest import PYTHON


def pid_of_rank(rank: int, marker: str) -> int:
    """The worker process of ``rank`` whose command line holds ``marker`` (Gloo sets HOROVOD_RANK)."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if marker.encode() in cmdline and f"HOROVOD_RANK={rank}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no process of rank {rank} found")


def wait_for_records(path: Path, count: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"{path} did not reach {count} records")


def test_sigusr1_to_one_rank_stops_both_then_resume_at_one_rank(tmp_path):
    run = tmp_path / "run"
    cmd = [str(BIN / "horovodrun"), "-np", "2", "--gloo", str(Path(PYTHON).with_name("hvdtrain")),
           "train", str(CONFIG), "train.epochs=30", "log.every_steps=5", "log.wandb=disabled",
           f"log.dir={run}"]
    proc = subprocess.Popen(cmd, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    wait_for_records(run / "metrics.jsonl", 4)
    os.kill(pid_of_rank(1, str(run)), signal.SIGUSR1)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode != 0  # horovodrun reports the ranks' exit code 75 as a failure
    stops = re.findall(r"\[(\d)\]<stderr>:hvdtrain: stopped on request at step (\d+)", out + err)
    assert sorted(rank for rank, _ in stops) == ["0", "1"], out[-2000:] + err[-2000:]
    step = int(stops[0][1])
    assert stops[1][1] == str(step)  # both ranks stopped after the same step
    meta = torch.load(run / "checkpoints" / f"step-{step:08d}.ckpt", weights_only=True)["meta"]
    assert meta["world_size"] == 2 and meta["position"]["step"] == step

    resumed = subprocess.run([str(BIN / "hvdtrain"), "train", str(CONFIG), "train.epochs=30",
                              f"log.dir={run}", "checkpoint.resume=auto", "log.wandb=disabled"],
                             env=run_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 1
    assert summary["samples"] == 30 * 1437  # every sample of every epoch, across the resize
    assert summary["final"]["eval_accuracy"] >= 0.95


def test_nan_on_one_rank_stops_both_at_the_same_step(tmp_path):
    cmd = [str(BIN / "horovodrun"), "-np", "2", "--gloo", str(Path(PYTHON).with_name("hvdtrain")),
           "train", str(CONFIG), "model.name=tests.torch.user_models:NanOnRank",
           "model.options={rank: 1, after: 3}",
           "log.wandb=disabled", f"log.dir={tmp_path}"]
    proc = subprocess.run(cmd, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    found = re.findall(r"\[(\d)\]<stderr>:hvdtrain: error: the loss became NaN or infinite on rank 1 "
                       r"at step 4;", proc.stdout + proc.stderr)
    assert sorted(found) == ["0", "1"], proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.timeout(400)
def test_sigkill_of_one_rank_ends_the_job_nonzero_within_a_minute(tmp_path):
    """Without elastic mode a dead rank must fail the whole job quickly, never leave it hanging."""
    run = tmp_path / "run"
    cmd = [str(BIN / "horovodrun"), "-np", "2", "--gloo", str(Path(PYTHON).with_name("hvdtrain")),
           "train", str(CONFIG), "train.epochs=200", "log.every_steps=5", "log.wandb=disabled",
           f"log.dir={run}"]
    proc = subprocess.Popen(cmd, env=run_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for_records(run / "metrics.jsonl", 3, timeout=300)
        os.kill(pid_of_rank(1, str(run)), signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(timeout=120)
        assert time.monotonic() - killed < 60
    finally:
        proc.kill()
    assert code != 0
    assert not (run / "summary.json").exists()
