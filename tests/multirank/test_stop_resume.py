"""A stop signal to one rank stops both at the same step; the run resumes at another world size.
A SIGTERM to every process of the ranks, loader workers included (as Slurm's preemption, `scancel`
and time limit send it), stops them the same way, in both frameworks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from hvdtrain.signals import EXIT_RESUBMIT
from tests.conftest import BIN, CONFIG, ROOT, run_env
from tests.image_data import image_folder
from tests.multirank.conftest import PYTHON

IMAGE_CONFIGS = {"torch": ROOT / "configs" / "images_torch.yaml",
                 "tensorflow": ROOT / "configs" / "images_tf.yaml"}


def pid_of_rank(rank: int, marker: str, variable: str = "HOROVOD_RANK") -> int:
    """The process of ``rank`` whose command line holds ``marker``: the one whose environment sets
    ``variable`` to ``rank`` (horovodrun's Gloo sets HOROVOD_RANK, mpirun OMPI_COMM_WORLD_RANK)."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if marker.encode() in cmdline and f"{variable}={rank}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no process with {variable}={rank} found")


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


def _stat(pid: int) -> tuple[int, str]:
    """A process's parent and state letter (Z: a zombie, no longer running)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[1]), fields[0]


def _alive(pid: int) -> bool:
    try:
        return _stat(pid)[1] != "Z"
    except (OSError, IndexError):
        return False


def _argv(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def rank_processes(launcher: int) -> tuple[list[int], list[int], list[int]]:
    """The ranks below ``launcher`` (horovodrun); every process below them (loader workers, the
    metrics writer); and of those the ranks' forks (PyTorch's loader workers: children with the
    rank's command line). A rank is ``python .../bin/hvdtrain train ...`` whose parent is not
    one. The processes above the ranks are left out: horovodrun's own (its spawned middlemen and
    their shells, which on a signal end the ranks themselves) and the rank wrapper."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _alive(int(entry.name)):
            with contextlib.suppress(OSError, IndexError):
                parents[int(entry.name)] = _stat(int(entry.name))[0]
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)

    def below(pid: int) -> list[int]:
        return [d for c in children.get(pid, []) for d in (c, *below(c))]

    def is_rank(pid: int) -> bool:
        argv = _argv(pid)
        return len(argv) > 2 and argv[1].endswith(b"bin/hvdtrain") and argv[2] == b"train"

    ranks = [pid for pid in below(launcher) if is_rank(pid) and not is_rank(parents[pid])]
    forks = [c for rank in ranks for c in children.get(rank, []) if _argv(c) == _argv(rank)]
    return ranks, [d for rank in ranks for d in below(rank)], forks


def wait_for_step(path: Path, timeout: float = 240) -> None:
    """Until ``path`` holds a first training record (polled often: the steps are fast)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and '"step"' in path.read_text():
            return
        time.sleep(0.02)
    raise AssertionError(f"{path}: no training record within {timeout} s")


MAX_STEPS = 40
"""Steps of the run: the signal is sent after the first record (step 5) and acts within two log
intervals or an epoch (8 steps); the resume trains the rest."""
SLOW_MS = 200
"""Rank 0 sleeps this long in every step (the straggler setting), so that the run cannot end
before the signal: unslowed, 40 steps take under a second and a loaded machine's metrics writer
has been seen to deliver the first record only after the last step."""
RANK_WRAPPER = 'trap : TERM; "$@"; echo $? >"$0-$HOROVOD_RANK"'
"""Runs a rank and writes its exit code to ``<$0>-<rank>``; the trap keeps the wrapper alive when
horovodrun, after the first rank's exit 75, sends SIGTERM to the others' (as Slurm's rank wrapper
records a rank's 75 for the requeue)."""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_sigterm_to_every_process_with_loader_workers_checkpoints_and_exits_75(
        framework, tmp_path):
    """Slurm's preemption, ``scancel`` and time limit send SIGTERM to every process of the step,
    data loader workers included. Every rank still checkpoints after the step they all stop at
    and exits 75, as a signal to the ranks alone does; the run resumes from there to its end.
    PyTorch's ``data.workers`` are processes (which the signal must not kill); TensorFlow's are
    tf.data threads of the rank, so there the ranks and their helper processes get it."""
    run = tmp_path / "run"
    images = image_folder(tmp_path / "images", train=128, test=32, size=16)
    overrides = [f"data.options.root={images}", "data.options.size=16", "model.options.width=4",
                 "data.batch_size=8", "data.workers=2", "train.epochs=1000",
                 f"train.max_steps={MAX_STEPS}", "log.every_steps=5", "checkpoint.every_steps=0",
                 "train.slow_rank=0", f"train.slow_ms={SLOW_MS}", "log.wandb=disabled",
                 f"log.dir={run}"]
    hvdtrain = str(Path(PYTHON).with_name("hvdtrain"))
    train = [hvdtrain, "train", str(IMAGE_CONFIGS[framework]), *overrides]
    codes = tmp_path / "exit"
    cmd = [str(BIN / "horovodrun"), "-np", "2", "--gloo", "bash", "-c", RANK_WRAPPER, str(codes),
           *train]
    proc = subprocess.Popen(cmd, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for_step(run / "metrics.jsonl")
        ranks, helpers, forks = rank_processes(proc.pid)
        for pid in (*ranks, *helpers):
            os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    output = out + err
    assert len(ranks) == 2, output[-3000:]
    # The signalled set holds both ranks' loader workers (PyTorch: forks of the rank), whose death
    # by the signal used to end the rank with an error and no checkpoint.
    assert len(forks) == (4 if framework == "torch" else 0), (ranks, helpers, forks)
    assert "is killed by signal" not in output, output[-3000:]
    assert [(codes.parent / f"exit-{rank}").read_text().strip() for rank in (0, 1)] == \
        [str(EXIT_RESUBMIT)] * 2, output[-3000:]
    stops = re.findall(r"\[(\d)\]<stderr>:hvdtrain: stopped on request at step (\d+)", output)
    assert sorted(rank for rank, _ in stops) == ["0", "1"], output[-3000:]
    step = int(stops[0][1])
    assert stops[1][1] == str(step) and 0 < step < MAX_STEPS
    # The only checkpoint is the stop's (checkpoint.every_steps=0), with the records up to it.
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*.json")) == \
        [f"step-{step:08d}.json"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records if "loss" in r) == step
    # The ranks ended their helpers on the way out: no signalled process outlives the job.
    assert not [pid for pid in helpers if _alive(pid)]

    resumed = subprocess.run([*train, "checkpoint.resume=auto"], env=run_env(),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == MAX_STEPS and summary["world_size"] == 1
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == MAX_STEPS  # continued, none twice
