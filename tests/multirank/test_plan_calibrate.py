"""``hvdtrain plan calibrate`` under ``horovodrun -np 3`` on this host writes a valid cluster file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from hvdtrain.plan.cluster import load_cluster
from tests.conftest import horovodrun


def test_calibrate_writes_a_cluster_file(tmp_path: Path) -> None:
    out = tmp_path / "calibrated.yaml"
    proc = horovodrun(3, "gloo", [sys.executable, "-m", "hvdtrain.cli", "plan", "calibrate",
                                  "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("wrote the cluster file") == 1  # rank 0 alone writes and says so
    cluster = load_cluster(out)  # every key checked as a user's file is
    assert (cluster.nodes, cluster.ranks_per_node) == (1, 3)
    assert cluster.intra.bandwidth_gbit_s > 0 and cluster.intra.latency_us > 0
    record = yaml.safe_load(out.read_text())["calibration"]
    assert record["measured"] == "intra" and len(record["hosts"]) == 3
    assert (record["ranks"], record["controller"]) == (3, "gloo")
    # Time grows with size: the largest allreduce takes longer than the smallest.
    assert record["allreduce_s"][-1] > record["allreduce_s"][0]


def test_calibrate_alone_is_a_one_line_error(tmp_path: Path) -> None:
    out = tmp_path / "calibrated.yaml"
    proc = subprocess.run([sys.executable, "-m", "hvdtrain.cli", "plan", "calibrate", "--out",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "needs at least 2 ranks" in proc.stderr and not out.exists()
