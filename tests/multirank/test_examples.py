"""The examples of docs/own-loop.md at two ranks: a PyTorch loop, a Keras ``fit`` and a
``tf.GradientTape`` loop as a Horovod user writes them, and each one converted to hvdtrain."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, horovodrun


def run_example(name: str, out: Path, *overrides: str) -> list[dict]:
    """Runs examples/<name>.py at two ranks; returns each rank's last JSON line, by rank."""
    proc = horovodrun(2, "gloo", [sys.executable, str(ROOT / "examples" / f"{name}.py"), str(out),
                                  *overrides], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = re.findall(r"^\[\d\]<stdout>:(\{.*\})$", proc.stdout, flags=re.M)
    records = sorted((json.loads(line) for line in lines), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1], proc.stdout[-3000:]
    return records


def check_trained(records: list[dict]) -> None:
    """The ranks hold the same weights and agree on a loss that fell."""
    first, second = records
    assert first["checksum"] == second["checksum"]
    assert first["loss"] == second["loss"] and len(first["loss"]) == 3
    assert first["loss"][-1] < first["loss"][0] / 2


def test_the_hvdtrain_conversions_train_checkpoint_and_log(tmp_path):
    for name in ("torch_hvdtrain", "keras_hvdtrain", "tape_hvdtrain"):
        out = tmp_path / name
        ranks = run_example(name, out, "log.console=false", "log.wandb=disabled")
        check_trained(ranks)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        # One record an epoch, at its end: the epochs done, the loss averaged over the ranks.
        assert [r["epoch"] for r in records] == [1, 2, 3]
        assert [r["loss"] for r in records] == pytest.approx(ranks[0]["loss"])
        # 1,797 samples in global batches of 64: 29 steps an epoch; the last one's checkpoint.
        assert [p.name for p in (out / "checkpoints").glob("*.ckpt")] == ["step-00000087.ckpt"]


@pytest.mark.long
@pytest.mark.parametrize("name", ["torch_horovod", "keras_horovod", "tape_horovod"])
def test_the_horovod_originals_train(tmp_path, name):
    check_trained(run_example(name, tmp_path))
    saved = {"torch_horovod": "model.pt", "keras_horovod": "model.weights.h5",
             "tape_horovod": "model.weights.h5"}[name]
    assert (tmp_path / saved).is_file()  # rank 0 saved
