"""Each benchmark of ``scripts/bench`` in its smallest configuration, once, end to end.

Real jobs (``horovodrun``, ``torchrun``), real measurements, nothing timed or compared: the tests
check that every driver runs its variants, collects one measurement per variant and round, and
prints a complete section with its table and verdict.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

# At import, not in the test: TensorFlow sets environment variables when first imported, which the
# leak check would pin on the test that happened to import it.
import hvdtrain.tensorflow.models  # noqa: F401
from hvdtrain.registry import DATASETS, MODELS
from tests.conftest import ROOT, run_env

BENCH = ROOT / "scripts" / "bench"


def run_driver(script: str, *args: str) -> str:
    """Runs ``script --quick --no-write`` and returns its section; fails with the output tail."""
    proc = subprocess.run([sys.executable, str(BENCH / script), "--quick", "--no-write", *args],
                          cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def table_rows(section: str) -> list[list[str]]:
    """The cells of every table row in ``section`` (header and rule lines excluded)."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith(("| name ", "| size "))]


@pytest.mark.timeout(900)
def test_allreduce_bandwidth_smallest_run_covers_both_controllers():
    section = run_driver("allreduce.py")
    rows = table_rows(section)
    # Two jobs (Gloo, MPI) x two sizes; every bandwidth and ratio a positive number.
    assert [r[0] for r in rows] == ["4 KB", "64 KB", "4 KB", "64 KB"]
    for row in rows:
        assert all(float(re.split(r" \(", cell)[0]) > 0 for cell in row[1:]), row
    assert "raw = torch.distributed gloo" in section and "raw = mpi4py Allreduce" in section
    assert section.count("no size of 64 MB or more was measured") == 2


@pytest.mark.timeout(900)
def test_fusion_smallest_run_measures_on_off_and_control():
    section = run_driver("fusion.py")
    names = [row[0] for row in table_rows(section)]
    assert names == ["fusion on (A)", "fusion off, threshold 0 (B)", "fusion on (A', A/A control)"]
    assert re.search(r"fusion off / fusion on = \d+\.\d{3}", section)


@pytest.mark.timeout(900)
def test_ddp_and_scaling_smallest_runs():
    section = run_driver("ddp.py")
    assert [row[0] for row in table_rows(section)] == [
        "DDP torchrun gloo (A)", "hvdtrain horovodrun gloo (B)", "hvdtrain horovodrun mpi (C)",
        "hand-written Horovod horovodrun gloo (D)", "DDP torchrun gloo (A', A/A control)"]
    assert re.search(r"hvdtrain horovodrun mpi / DDP = \d+\.\d{3}", section)
    assert re.search(r"hvdtrain gloo / hand-written Horovod = \d+\.\d{3}", section)
    section = run_driver("scaling.py")
    assert [row[1] for row in table_rows(section)] == ["1", "1", "1", "1"]  # one run each
    assert re.search(r"efficiency = tput\(2\) / \(2 x tput\(1\)\) = \d+\.\d{3}", section)
    assert re.search(r"kept \d+\.\d{3} of that ceiling \(B/C\)", section)


@pytest.mark.timeout(900)
def test_step_time_benchmarks_smallest_runs(tmp_path):
    """overhead.py (both frameworks), frameworks.py and monitoring.py: one interleaved job each."""
    records = tmp_path / "runs.jsonl"
    for script, args, baseline in (
            ("overhead.py", ["--framework", "torch"], "handwritten (A)"),
            ("overhead.py", ["--framework", "tensorflow"], "handwritten (A)"),
            ("monitoring.py", ["--framework", "torch", "--between", "--records", str(records)],
             "sinks off (A)"),
            ("frameworks.py", [], None)):
        section = run_driver(script, *args)
        rows = table_rows(section)
        assert rows and all(row[1] == "1" for row in rows), (script, section)
        if baseline:
            assert rows[0][0] == baseline and "A/A control = " in section, section
        if script == "monitoring.py":  # five blocks, muted and live by turns, inside the W run
            assert re.search(r"live / muted = \d+\.\d{3}, A/A control \(W0\) = \d+\.\d{3}",
                             section)
            assert re.search(r"noise added\): \d+\.\d{3}, 95% bootstrap interval", section)
            runs = [json.loads(line) for line in records.read_text().splitlines()]
            assert [run["slot"] for run in runs] == [0, 1, 2, 3, 4]  # every run, as it came


@pytest.mark.timeout(900)
def test_compression_checkpoint_and_recovery_smallest_runs(tmp_path):
    section = run_driver("compression.py")
    rows = {row[0]: row for row in table_rows(section) if row[0] != "framework dataset method"}
    assert set(rows) == {"torch digits none", "torch digits topk", "torch digits powersgd"}
    assert rows["torch digits none"][5] == "1.0" and float(rows["torch digits topk"][5]) > 10
    assert "Accuracy bars, torch digits" in section
    doc = tmp_path / "bench.md"
    for script, args in (("checkpoint.py", ["--rounds", "2", "--hidden", "64"]),
                         ("elastic_recovery.py", ["--trials", "1", "--frameworks", "torch"])):
        proc = subprocess.run([sys.executable, str(BENCH / script), *args, "--out", str(doc)],
                              cwd=ROOT, env=run_env(), capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    text = doc.read_text()
    assert "## Checkpoint save" in text and "## Elastic recovery" in text


def test_resnet18_has_resnet18_size_and_trains_on_synthetic_images():
    import torch

    data = DATASETS.get("synthetic_images")(train_samples=8, test_samples=2)
    model = MODELS["torch"].get("resnet18")().build(data.spec())
    assert sum(p.numel() for p in model.parameters()) == 11_181_642  # torchvision's, 10 classes
    logits = model(torch.from_numpy(data.train().x[:4]))
    assert logits.shape == (4, 10)
    narrow = MODELS["torch"].get("resnet18")(width=8).build(data.spec())
    assert sum(p.numel() for p in narrow.parameters()) < 200_000


def test_tensorflow_resnet18_matches_the_torch_parameter_count():
    data = DATASETS.get("synthetic_images")(train_samples=4, test_samples=2)
    model = MODELS["tensorflow"].get("resnet18")().build(data.spec())
    assert sum(int(np.prod(v.shape)) for v in model.trainable_variables) == 11_181_642
    assert tuple(model(data.train().x).shape) == (4, 10)
