"""scripts/gpu_check.py, the GPU check's measurements, tried on CPU at tiny sizes: one row per
precision and trainer, with a rate, a finite loss, the device and the collectives."""

import json
import math
import subprocess
import sys

from tests.conftest import ROOT, run_env


def test_gpu_check_measures_both_trainers_per_precision_on_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--steps", "3",
         "--skip", "1", "--width", "8", "--batch", "8", "--precisions", "fp32,bf16",
         "--out", str(tmp_path)], env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("| precision | trainer | samples/s | ratio to plain | final train loss")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [("fp32", "plain PyTorch"), ("fp32", "hvdtrain"),
                                            ("bf16", "plain PyTorch"), ("bf16", "hvdtrain")]
    for precision, trainer, rate, ratio, loss, device, collectives in rows:
        assert float(rate) > 0 and math.isfinite(float(loss)) and device == "cpu"
        if trainer == "plain PyTorch":
            assert (ratio, collectives) == ("1.000", "-")
        else:
            assert float(ratio) > 0 and collectives in ("gloo", "mpi")
            summary = json.loads((tmp_path / f"hvdtrain-{precision}" / "summary.json").read_text())
            assert (summary["precision"], summary["device"]) == (precision, "cpu")


def test_gpu_check_refuses_a_skip_past_the_steps(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu",
                           "--steps", "3", "--skip", "3", "--out", str(tmp_path)], env=run_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "--skip 3: give a number of steps from 0 to --steps - 1 (2)")
