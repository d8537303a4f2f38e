"""Pipeline stages across hosts: a 2-stage pipeline with its stages on two namespace nodes
(``horovodrun -H node1:1,node2:1``: every micro-batch's activations and gradients cross the link,
through the ``torch.distributed`` rendezvous rank 0 hands out), and a 2 stages x 2 copies job on two
nodes under Slurm (each node one pipeline copy; each stage's Horovod average crosses the link).
The first ends as the same job on one host does; the second as one process without stages on the
global batch (2 copies x 32 samples at the rate scaled by the copies against 64 at that rate, no
warm-up, whose ramp from the one-rank rate would differ), to float rounding."""

from __future__ import annotations

import subprocess

import pytest

from tests.cluster.conftest import (
    HOSTS,
    NODES,
    check_on_two_nodes,
    horovodrun,
    job_field,
    job_log,
    submit,
    summary,
    train_argv,
    wait_state,
)
from tests.conftest import run_env

PIPELINE = ("pipeline.stages=2", "pipeline.microbatches=4", "train.epochs=2")
WHOLE = ("data.batch_size=64", "optim.lr=0.1", "optim.warmup_steps=0", "train.epochs=2")
"""One process on the 2x2 job's global batch at its scaled rate (the config's 0.05 x 2 copies)."""


@pytest.fixture(scope="module")
def one_host(tmp_path_factory) -> dict:
    """The same 2-stage run, both ranks on the launcher's host."""
    run = tmp_path_factory.mktemp("pipe-one-host") / "run"
    proc = horovodrun(run_env(), "-np", "2", "--gloo", *train_argv(run, *PIPELINE))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return summary(run)


def test_two_stages_on_two_nodes_train_as_on_one_host(cluster, one_host, tmp_path):
    run = tmp_path / "run"
    proc = horovodrun(cluster, "-np", "2", "-H", HOSTS, "--gloo", *train_argv(run, *PIPELINE))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = summary(run)
    check_on_two_nodes(result)  # stage 0 on node1, stage 1 on node2
    assert result["samples"] == one_host["samples"] and result["steps"] == one_host["steps"]
    # the same arithmetic on the same machine's kernels, only the transport differs
    for key in ("train_loss", "eval_loss", "eval_accuracy"):
        assert result["final"][key] == pytest.approx(one_host["final"][key], rel=1e-5), key


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """The 2x2 job's training in one process without stages, on the launcher's host."""
    run = tmp_path_factory.mktemp("pipe-one-process") / "run"
    proc = subprocess.run(train_argv(run, *WHOLE), env=run_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return summary(run)


def test_two_stages_by_two_copies_on_two_nodes_under_slurm(cluster, one_process, tmp_path):
    run = tmp_path / "run"
    job_id = submit(cluster, run, *PIPELINE, "optim.warmup_steps=0", "log.console=false",
                    tasks_per_node=2)
    state = wait_state(cluster, job_id, timeout=300)
    assert state == "COMPLETED", job_log(run, job_id)
    result = summary(run)
    assert result["world_size"] == 4 and job_field(cluster, job_id, "NodeList") == "node[1-2]"
    # ranks 0, 1 (copy 0: stages 0 and 1) on node1, ranks 2, 3 (copy 1) on node2
    assert result["hosts"] == [NODES[0], NODES[0], NODES[1], NODES[1]], result["hosts"]
    assert result["pipeline"] == "2 stages x 2 copies"
    assert result["samples"] == one_process["samples"] and result["steps"] == one_process["steps"]
    final, want = result["final"], one_process["final"]
    for key in ("train_loss", "eval_loss"):
        assert final[key] == pytest.approx(want[key], rel=1e-4), (key, final, want)
    assert abs(final["eval_accuracy"] - want["eval_accuracy"]) <= 1 / 360, (final, want)
    assert final["eval_accuracy"] > 0.8, final
