"""The local multi-node cluster for the cross-node tests: two network-namespace nodes with their own
sshd (``scripts/cluster_local.sh``) and Slurm over them (``scripts/slurm_local.sh start --nodes``).

``make test`` starts and stops it around the suite; a pytest run on its own starts it here when it
is not up, and then stops it at the end of the session."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, CONFIG, ROOT, run_env

CLUSTER_DIR = Path(os.environ.get("HVDTRAIN_CLUSTER_DIR", "/run/hvdtrain-cluster"))
NODES = ["node1", "node2"]
HOSTS = "node1:1,node2:1"
TRAIN_SAMPLES = 1437  # digits: 1,797 samples, 20% held out


def cluster_env() -> dict[str, str]:
    """The launcher's environment: the cluster's ssh wrapper first on PATH, Slurm over the nodes."""
    env = run_env()
    env.update(PATH=f"{CLUSTER_DIR / 'bin'}{os.pathsep}{env['PATH']}",
               SLURM_CONF=str(CLUSTER_DIR / "slurm" / "slurm.conf"),
               HVDTRAIN_CLUSTER_DIR=str(CLUSTER_DIR))
    return env


def cluster_script(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs ``scripts/cluster_local.sh ARGS`` (or ``slurm_local.sh`` when args[0] names it)."""
    script = "slurm_local.sh" if args[0] == "slurm" else "cluster_local.sh"
    argv = args[1:] if args[0] == "slurm" else args
    env = {**os.environ, "HVDTRAIN_CLUSTER_DIR": str(CLUSTER_DIR)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / script), *argv], capture_output=True,
                          text=True, timeout=180, env=env)
    assert not check or proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The life-cycle tests stop and restart the cluster: they run after every other test here."""
    here = Path(__file__).parent
    lifecycle = [item for item in items if item.path == here / "test_lifecycle.py"]
    rest = [item for item in items if item.path != here / "test_lifecycle.py"]
    end = max((n + 1 for n, item in enumerate(rest) if here in item.path.parents), default=len(rest))
    items[:] = rest[:end] + lifecycle + rest[end:]


@pytest.fixture(scope="session")
def cluster() -> dict[str, str]:
    """The two nodes, unshaped, with Slurm idle on both; yields the launcher's environment. A
    cluster already started (by ``make test``, or by someone else, perhaps with more nodes or a
    node whose ssh does not answer right now, which ``status`` reports by exiting 1) is used as it
    is and left running: ``start 2`` would remove its nodes past the second."""
    was_up = "no cluster started" not in cluster_script("status", check=False).stdout
    if not was_up:
        cluster_script("start", "2", "--bandwidth", "none")
    try:
        cluster_script("slurm", "start", "--nodes")
        yield cluster_env()
    finally:
        if not was_up:
            cluster_script("stop")


def train_argv(run: Path, *overrides: str, config: Path = CONFIG) -> list[str]:
    """``hvdtrain train`` writing to ``run``, quiet and without W&B."""
    return [str(BIN / "hvdtrain"), "train", str(config), f"log.dir={run}", "log.wandb=disabled",
            "log.console=false", *overrides]


def horovodrun(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``horovodrun ARGS`` from the root namespace (the launcher's host), output kept."""
    return subprocess.run([str(BIN / "horovodrun"), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def summary(run: Path) -> dict:
    """Rank 0's ``summary.json``."""
    return json.loads((run / "summary.json").read_text())


def node_namespace(node: str) -> str:
    """The network namespace of ``node`` as a process inside it reads it (``net:[inode]``)."""
    proc = subprocess.run(["ip", "netns", "exec", node, "readlink", "/proc/self/ns/net"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def check_on_two_nodes(result: dict) -> None:
    """Rank r ran on node r+1, by its host name and by its network namespace, which is node r+1's."""
    assert result["hosts"] == NODES, result["hosts"]
    assert result["net_namespaces"] == [node_namespace(node) for node in NODES], result["net_namespaces"]


# --- Slurm over the nodes ----------------------------------------------------------------------

def slurm(env: dict[str, str], *argv: str) -> str:
    """A Slurm client command against the nodes' cluster; its standard output."""
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60).stdout


def job_field(env: dict[str, str], job_id: str, name: str) -> str:
    found = re.search(rf"\b{name}=(\S+)", slurm(env, "scontrol", "show", "job", job_id))
    return found.group(1) if found else ""


def wait_state(env: dict[str, str], job_id: str, timeout: float) -> str:
    """Waits until the job has ended; its final state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_field(env, job_id, "JobState")
        if state in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}:
            return state
        time.sleep(1)
    raise AssertionError(f"job {job_id} still {job_field(env, job_id, 'JobState')} after {timeout} s")


def submit(env: dict[str, str], run: Path, *args: str, nodes: int = 2,
           tasks_per_node: int = 1) -> str:
    """``hvdtrain slurm submit`` of a 2-node job (one task per node unless told); the job id."""
    proc = subprocess.run([str(BIN / "hvdtrain"), "slurm", "submit", str(CONFIG), f"log.dir={run}",
                           "log.wandb=disabled", "--nodes", str(nodes), "--tasks-per-node",
                           str(tasks_per_node),
                           "--time", "20:00", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    found = re.search(r"submitted job (\d+)", proc.stdout)
    assert found, proc.stdout
    return found.group(1)


def job_log(run: Path, job_id: str) -> str:
    path = run / f"slurm-{job_id}.out"
    return path.read_text() if path.exists() else "(no log)"
