"""Parameter servers on a node of their own under Slurm: ``hvdtrain slurm submit --nodes 1
--tasks-per-node 2 --server-nodes 1`` with ``comm.topology=ps`` on the two namespace nodes puts the
two workers on node1 and the server (the last rank) on node2, under horovodrun over Open MPI and
under srun (PMIx, ``--distribution=arbitrary``): every push and pull crosses the link."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import NODES, job_field, job_log, submit, summary, wait_state

PS = ("comm.topology=ps", "ps.servers=1", "train.epochs=3", "log.console=false")


@pytest.mark.parametrize("options", [
    ("--controller", "mpi", "--network-interface", "br-hvd"),
    ("--launcher", "srun", "--network-interface", "br-hvd"),
], ids=["horovodrun-mpi", "srun"])
def test_workers_on_one_node_and_the_server_on_another(cluster, tmp_path, options):
    run = tmp_path / "run"
    job_id = submit(cluster, run, *PS, "--server-nodes", "1", *options, nodes=1, tasks_per_node=2)
    state = wait_state(cluster, job_id, timeout=300)
    assert state == "COMPLETED", job_log(run, job_id)
    assert job_field(cluster, job_id, "NodeList") == "node[1-2]"
    result = summary(run)
    # the summary lists the workers: both on node1, so the job's third rank, the server, ran on node2
    assert result["world_size"] == 2 and result["hosts"] == [NODES[0], NODES[0]], result["hosts"]
    assert result["topology"] == "ps" and result["ps_servers"] == 1
    assert result["final"]["eval_accuracy"] > 0.8, result["final"]
