"""``hvdtrain plan profile`` on the digits MLP in TensorFlow, then ``hvdtrain plan`` on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _hvdtrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hvdtrain.cli", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=180)


def test_profile_then_plan(tmp_path: Path) -> None:
    profile = tmp_path / "digits_tf.json"
    made = _hvdtrain("plan", "profile", "configs/digits_tf.yaml", "train.threads=1", "--out",
                     str(profile))
    assert made.returncode == 0, made.stderr[-3000:]
    data = json.loads(profile.read_text())
    assert data["source"].endswith(", 1 thread(s)")  # as a rank of train.threads=1 trains
    assert data["model"] == {"framework": "tensorflow", "name": "mlp", "options": {"hidden": [128]}}
    # From the layer chain: the head's gradients are ready before fc1's.
    assert [t["name"] for t in data["tensors"]] == ["head/kernel", "head/bias", "fc1/kernel",
                                                    "fc1/bias"]
    ready = [t["ready_s"] for t in data["tensors"]]
    assert ready == sorted(ready) and ready[-1] > ready[0]
    assert [t["bytes"] for t in data["tensors"]] == [4 * 1280, 40, 4 * 64 * 128, 512]
    assert [x["params"] for x in data["layers"]] == [0, 64 * 128 + 128, 128 * 10 + 10]
    assert data["layers"][1]["activation_bytes"] == 32 * 128 * 4
    # Timed at a quarter of the batch too: what a smaller batch does not shrink, within each time.
    for key in ("forward_s", "backward_s"):
        assert all(0 <= x["fixed_" + key] <= x[key] for x in data["layers"])
    assert any(x["fixed_backward_s"] > 0 for x in data["layers"])
    methods = data["compression"]
    assert methods["fp16"]["ratio"] == 2.0 and methods["qsgd"]["collective"] == "allgather"
    assert methods["powersgd"]["kernel_s"] > 0
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes: 2\nranks_per_node: 2\nintra: {bandwidth_gbit_s: 10, latency_us: 2}"
                       "\ninter: {bandwidth_gbit_s: 1, latency_us: 50}\n")
    planned = _hvdtrain("plan", "configs/digits_tf.yaml", "--cluster", str(cluster), "--profile",
                        str(profile))
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "* the config's setting: ring" in planned.stdout
