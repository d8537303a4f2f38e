"""``hvdtrain slurm submit --nodes 2 --tasks-per-node 1`` on Slurm over the two namespace nodes: one
rank per node with the default launcher (horovodrun over ssh inside the job), with horovodrun over
Open MPI and with srun (PMIx); a 2-node job preempted by USR1 that checkpoints on both nodes, is
requeued and resumes; and an elastic job (``elastic.sbatch``) that goes on alone when Slurm drains
one of its nodes."""

from __future__ import annotations

import json
import re
import subprocess
import time

import numpy as np
import pytest

from tests.cluster.conftest import (
    TRAIN_SAMPLES,
    check_on_two_nodes,
    job_field,
    job_log,
    slurm,
    submit,
    summary,
    wait_state,
)
from tests.conftest import read_jsonl


@pytest.mark.parametrize("options", [
    (),
    # the batch node's SLURMD_NODENAME reaches every rank through horovodrun --mpi's -x: each rank
    # must still be named after its own node
    ("--controller", "mpi", "--network-interface", "br-hvd"),
    ("--launcher", "srun", "--network-interface", "br-hvd"),
], ids=["horovodrun-gloo", "horovodrun-mpi", "srun"])
def test_job_trains_one_rank_per_node(cluster, tmp_path, options):
    run = tmp_path / "run"
    job_id = submit(cluster, run, "train.epochs=3", "log.console=false", *options)
    state = wait_state(cluster, job_id, timeout=300)
    assert state == "COMPLETED", job_log(run, job_id)
    result = summary(run)
    assert result["world_size"] == 2
    check_on_two_nodes(result)
    assert job_field(cluster, job_id, "NodeList") == "node[1-2]"


def test_preempted_two_node_job_checkpoints_on_both_requeues_and_resumes(cluster, tmp_path):
    """The default launcher: horovodrun inside the job starts the ranks on both nodes over ssh."""
    run, epochs = tmp_path / "run", 30
    job_id = submit(cluster, run, f"train.epochs={epochs}", "log.every_steps=5", "log.console=false",
                    "checkpoint.every_steps=1000")
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline, job_log(run, job_id)
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=cluster, check=True)
    state = wait_state(cluster, job_id, timeout=420)
    log = job_log(run, job_id)
    assert state == "COMPLETED", log
    assert job_field(cluster, job_id, "Restarts") == "1", log
    assert "requeueing job" in log and "restart count 1" in log, log
    # each rank (one per node) stopped after the same step's checkpoint
    stops = dict(re.findall(r"\[(\d)\]<stderr>:hvdtrain: stopped on request at step (\d+)", log))
    assert set(stops) == {"0", "1"} and stops["0"] == stops["1"], log
    assert "checkpoint not written" not in log, log
    written = set(re.findall(r"\]<stderr>:hvdtrain: stopped on request at step \d+; checkpoint (\S+);", log))
    stop_checkpoint = run / "checkpoints" / f"step-{int(stops['0']):08d}.ckpt"
    assert written == {str(stop_checkpoint)} and stop_checkpoint.exists(), (written, log)
    result = summary(run)
    check_on_two_nodes(result)
    assert result["world_size"] == 2
    assert result["samples"] == epochs * TRAIN_SAMPLES  # every sample once per epoch, across the stop
    steps = [record["step"] for record in map(json.loads, metrics.read_text().splitlines())]
    assert steps == sorted(set(steps)), "a step was logged twice after the resume"


def wait_for_records(run, job_id: str, count: int, timeout: float) -> None:
    """Waits until the job's run has logged ``count`` metrics records."""
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= count):
        assert time.monotonic() < deadline, job_log(run, job_id)
        time.sleep(0.5)


def test_elastic_job_goes_on_when_a_node_is_drained(cluster, tmp_path):
    """``--elastic``: the job's host discovery drops a drained node; its rank leaves, the other
    trains on alone from the last commit, and the job completes with every sample once per epoch."""
    # 8 epochs: node2 drained after step 15 leaves the job in 2-3 s (seen), then about 15 s of
    # training alone at 0.05 s a step; at 20 epochs that was 46 s, spent after the checks' events.
    run, epochs, commit_every = tmp_path / "run", 8, 10
    job_id = submit(cluster, run, f"train.epochs={epochs}", "log.every_steps=5", "log.console=false",
                    "elastic.record_indices=true", f"elastic.commit_every={commit_every}",
                    "optim.schedule=constant", "optim.warmup_steps=0",
                    "model.name=tests.multirank.elastic_models:PacedMLP",
                    "model.options={hidden: [128], pause: 0.05}",
                    "--elastic", "--min-nodes", "1", "--network-interface", "br-hvd")
    wait_for_records(run, job_id, 3, timeout=240)
    assert job_field(cluster, job_id, "NodeList") == "node[1-2]"
    slurm(cluster, "scontrol", "update", "nodename=node2", "state=drain", "reason=hvdtrain-test")
    try:
        assert "drain" in slurm(cluster, "sinfo", "-h", "-n", "node2", "-o", "%T")
        state = wait_state(cluster, job_id, timeout=420)
    finally:
        slurm(cluster, "scontrol", "update", "nodename=node2", "state=resume")
    log = job_log(run, job_id)
    assert state == "COMPLETED", log
    events = read_jsonl(run / "elastic.jsonl")[1:]
    shrink = [e for e in events if e["event"] == "reset" and e["world_size"] == 1]
    assert shrink, (events, log)
    assert 0 <= shrink[0]["lost_steps"] <= commit_every
    result = summary(run)
    assert result["world_size"] == 1 and result["hosts"] == ["node1"], result
    assert result["elastic"]["resets"] >= 1
    assert result["samples"] == epochs * TRAIN_SAMPLES
    paths = sorted((run / "indices").glob("epoch-*.npy"))
    assert len(paths) == epochs
    for path in paths:  # every sample once per epoch
        assert np.array_equal(np.sort(np.load(path)), np.arange(TRAIN_SAMPLES)), path.name
    steps = [record["step"] for record in read_jsonl(run / "metrics.jsonl")]
    assert steps == sorted(set(steps))
    assert "idle" in slurm(cluster, "sinfo", "-h", "-n", "node2", "-o", "%T")
