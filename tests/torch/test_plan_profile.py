"""``hvdtrain plan profile`` on the digits MLP, then ``hvdtrain plan`` on the profile it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _hvdtrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hvdtrain.cli", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=120)


def test_profile_then_plan(tmp_path: Path) -> None:
    profile = tmp_path / "digits.json"
    made = _hvdtrain("plan", "profile", "configs/digits_torch.yaml", "train.threads=1", "--out",
                     str(profile))
    assert made.returncode == 0, made.stderr
    data = json.loads(profile.read_text())
    assert data["source"].endswith(", 1 thread(s)")  # as a rank of train.threads=1 trains
    # The MLP 64 -> 128 -> 10: two weights and two biases.
    assert sorted(t["bytes"] for t in data["tensors"]) == [40, 512, 4 * 1280, 4 * 64 * 128]
    assert [x["params"] for x in data["layers"] if x["params"]] == [64 * 128 + 128, 128 * 10 + 10]
    assert data["layers"][1]["activation_bytes"] == 32 * 128 * 4  # fc1's output, batch 32
    # Timed at a quarter of the batch too: what a smaller batch does not shrink, within each time.
    for key in ("forward_s", "backward_s"):
        assert all(0 <= x["fixed_" + key] <= x[key] for x in data["layers"])
    assert any(x["fixed_backward_s"] > 0 for x in data["layers"])
    methods = data["compression"]
    assert methods["none"]["ratio"] == 1.0 and methods["fp16"]["ratio"] == 2.0
    assert methods["topk"]["collective"] == "allgather" and methods["topk"]["ratio"] > 10
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes: 4\nranks_per_node: 2\nintra: {bandwidth_gbit_s: 10, latency_us: 2}"
                       "\ninter: {bandwidth_gbit_s: 0.1, latency_us: 100}\n")
    planned = _hvdtrain("plan", "configs/digits_torch.yaml", "--cluster", str(cluster),
                        "--profile", str(profile), "--json", str(tmp_path / "p.json"))
    assert planned.returncode == 0, planned.stderr
    assert "ring topk" in planned.stdout and "not applicable" in planned.stdout
    other = _hvdtrain("plan", "configs/digits_torch.yaml", "model.options.hidden=[64]",
                      "--cluster", str(cluster), "--profile", str(profile))
    assert other.returncode == 2 and "another model" in other.stderr
