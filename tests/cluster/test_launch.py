"""``horovodrun -H node1:1,node2:1`` over ssh to two network-namespace nodes, over Gloo and MPI:
the same training as on one host; and a node that does not answer at start fails the launch with
its name, in bounded time."""

from __future__ import annotations

import time

import pytest

from tests.cluster.conftest import HOSTS, check_on_two_nodes, cluster_script, horovodrun, summary, train_argv
from tests.conftest import assert_accuracy_near, run_env

EPOCHS = "train.epochs=5"


@pytest.fixture(scope="module")
def one_host(tmp_path_factory) -> dict:
    """The same two-rank run on the launcher's host alone."""
    run = tmp_path_factory.mktemp("one-host") / "run"
    proc = horovodrun(run_env(), "-np", "2", "--gloo", *train_argv(run, EPOCHS))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return summary(run)


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_two_nodes_train_as_one_host(cluster, one_host, tmp_path, controller):
    run = tmp_path / "run"
    proc = horovodrun(cluster, "-np", "2", "-H", HOSTS, f"--{controller}", *train_argv(run, EPOCHS))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = summary(run)
    check_on_two_nodes(result)
    assert result["world_size"] == 2 and result["samples"] == one_host["samples"]
    # two ranks sum the same two gradients wherever they run: the same model, to rounding (and to
    # the margin of the 360 test samples where the nodes' kernels differ from the launcher's)
    assert_accuracy_near(result["final"]["eval_accuracy"], one_host["final"]["eval_accuracy"],
                         "two nodes against one host", above_too=True)
    assert result["final"]["train_loss"] == pytest.approx(one_host["final"]["train_loss"], rel=0.05)


@pytest.mark.parametrize("failure", [("sshd", "2", "stop"), ("link", "2", "down")],
                         ids=["sshd-down", "link-cut"])
def test_a_node_that_does_not_answer_fails_the_launch_naming_it(cluster, tmp_path, failure):
    """sshd stopped: the connection is refused; link cut: nothing answers, and the cluster's ssh
    config (ConnectTimeout) bounds the wait."""
    restore = {"stop": "start", "down": "up"}[failure[2]]
    cluster_script(*failure)
    try:
        started = time.monotonic()
        proc = horovodrun(cluster, "-np", "2", "-H", HOSTS, "--gloo", *train_argv(tmp_path / "run", EPOCHS),
                          timeout=120)
        elapsed = time.monotonic() - started
    finally:
        cluster_script(*failure[:2], restore)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "ssh: connect to host node2" in output, output[-3000:]
    assert elapsed < 90, elapsed
