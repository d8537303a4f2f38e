"""The cluster scripts' own life cycle: ``cluster_local.sh start`` on a running cluster changes
nothing, ``--bandwidth`` shapes every link and ``none`` unshapes them, Slurm over the nodes comes
back idle after a stop, and ``stop`` leaves nothing behind, after which ``start`` builds it again.

These tests run after every other test of tests/cluster (``conftest.py`` moves them there), and
each leaves the cluster as the session fixture started it: two unshaped nodes, Slurm idle on both."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.cluster.conftest import CLUSTER_DIR, NODES, cluster_script, node_namespace, slurm

MARK = "# hvdtrain-cluster"
BRIDGE = "br-hvd"


def snapshot() -> dict:
    """What a repeated start must leave alone: each node's namespace and sshd, the hosts lines."""
    hosts = [line for line in Path("/etc/hosts").read_text().splitlines() if line.endswith(MARK)]
    return {"namespaces": [node_namespace(node) for node in NODES], "hosts": hosts,
            "sshd": [(CLUSTER_DIR / node / "sshd.pid").read_text() for node in NODES]}


def rates() -> dict[str, str]:
    """Each node's link rate as ``cluster_local.sh status`` shows it (every node answering ssh)."""
    lines = re.findall(r"^(node\d+) \S+ link UP rate (\S+) ssh ok$", cluster_script("status").stdout, re.M)
    return dict(lines)


def slurm_nodes(env: dict[str, str]) -> dict[str, str]:
    """Each node's state in ``sinfo -N`` of the cluster over the nodes."""
    return dict(line.split() for line in slurm(env, "sinfo", "-h", "-N", "-o", "%N %T").splitlines())


def processes_in(namespaces: list[str]) -> list[str]:
    """The live processes whose network namespace is one of ``namespaces``."""
    found = []
    for ns_link in Path("/proc").glob("[0-9]*/ns/net"):
        try:
            if os.readlink(ns_link) in namespaces:
                found.append(ns_link.parent.parent.name)
        except OSError:  # ended meanwhile, or a zombie
            continue
    return found


def test_start_on_a_running_cluster_changes_nothing(cluster):
    before = snapshot()
    cluster_script("start", "2")
    assert snapshot() == before
    assert len(before["hosts"]) == len(NODES)


def test_bandwidth_shapes_every_link_and_none_unshapes_them(cluster):
    try:
        cluster_script("start", "2", "--bandwidth", "100mbit")
        assert rates() == {node: "100Mbit" for node in NODES}
    finally:
        cluster_script("start", "2", "--bandwidth", "none")
    assert rates() == {node: "unshaped" for node in NODES}


def test_slurm_over_the_nodes_comes_back_idle_after_a_stop(cluster):
    """A stop may leave munged ``<defunct>``: the start must not take that for a running one."""
    cluster_script("slurm", "stop", "--nodes")
    assert not (CLUSTER_DIR / "slurm").exists()
    cluster_script("slurm", "start", "--nodes")
    assert slurm_nodes(cluster) == {node: "idle" for node in NODES}


def test_stop_leaves_nothing_and_start_builds_it_again(cluster):
    namespaces = [node_namespace(node) for node in NODES]
    try:
        cluster_script("stop")
        assert not set(NODES) & set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                   text=True).stdout.split())
        assert subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode != 0
        assert not [line for line in Path("/etc/hosts").read_text().splitlines() if line.endswith(MARK)]
        assert not CLUSTER_DIR.exists()
        assert processes_in(namespaces) == []  # sshd, slurmd, ssh sessions: none lives on
    finally:
        cluster_script("start", "2", "--bandwidth", "none")
        cluster_script("slurm", "start", "--nodes")
    assert rates() == {node: "unshaped" for node in NODES}
    assert slurm_nodes(cluster) == {node: "idle" for node in NODES}
