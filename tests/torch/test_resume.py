"""Checkpoints that resume exactly, survive corruption, refuse the wrong model, and stop on signal."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from hvdtrain.driver import train
from hvdtrain.errors import HvdtrainError
from tests.conftest import BIN, CONFIG, ROOT, quiet_config, read_jsonl, run_env

# Constant schedule: a first run cut short by max_steps then follows the same learning rates.
EXACT = ("train.epochs=4", "optim.schedule=constant", "checkpoint.every_steps=40")
# Dropout draws from torch's generator at every step: resuming is exact only if its state is restored.
DROPOUT = "model.name=tests.torch.test_resume:dropout_net"


def dropout_net(spec, hidden: tuple[int, ...] = (64,)) -> nn.Module:
    """An MLP with dropout, so that training consumes random numbers."""
    return nn.Sequential(nn.Flatten(), nn.Linear(spec.input_shape[0], hidden[0]), nn.ReLU(),
                         nn.Dropout(0.2), nn.Linear(hidden[0], spec.num_classes))


def params_of(path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def test_stop_and_resume_is_bit_identical(tmp_path):
    straight = train(quiet_config(CONFIG, tmp_path / "a", *EXACT, DROPOUT))
    first = train(quiet_config(CONFIG, tmp_path / "b", *EXACT, DROPOUT, "train.max_steps=100"))
    assert first.summary["steps"] == 100  # mid-epoch: 100 = 2 x 45 + 10
    # Draws between the checkpoint and the resume must not matter: the generators are restored.
    torch.rand(1000)
    resumed = train(quiet_config(CONFIG, tmp_path / "b", *EXACT, DROPOUT, "checkpoint.resume=auto"))
    assert resumed.summary["steps"] == straight.summary["steps"] == 180
    for key, value in straight.engine.parameters().items():
        assert np.array_equal(resumed.engine.parameters()[key], value), key
    assert resumed.summary["final"] == straight.summary["final"]
    steps = [r["step"] for r in read_jsonl(tmp_path / "b" / "run" / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == 180


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    train(quiet_config(CONFIG, tmp_path, *EXACT, "train.max_steps=120"))
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in ckpts] == ["step-00000040.ckpt", "step-00000080.ckpt", "step-00000120.ckpt"]
    data = bytearray(ckpts[-1].read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    ckpts[-1].write_bytes(bytes(data))
    ckpts[-2].write_bytes(ckpts[-2].read_bytes()[:-100])  # truncated
    with pytest.warns(UserWarning) as caught:
        result = train(quiet_config(CONFIG, tmp_path, *EXACT, "checkpoint.resume=auto",
                                    "train.max_steps=120"))
    messages = [str(w.message) for w in caught]
    assert any("step-00000120.ckpt: sha256 differs" in m for m in messages)
    assert any("step-00000080.ckpt: size differs" in m for m in messages)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if r["step"] in (40, 50)] == [40, 50]  # resumed after 40
    assert result.summary["steps"] == 120


def test_checkpoint_of_another_model_is_refused_clearly(tmp_path):
    train(quiet_config(CONFIG, tmp_path, "train.epochs=1"))
    ckpt = next((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    with pytest.raises(HvdtrainError, match=r"step-00000045.ckpt does not fit the model: .*size mismatch"):
        train(quiet_config(CONFIG, tmp_path / "b", "model.options={hidden: [32]}",
                           f"checkpoint.resume={ckpt}"))
    with pytest.raises(HvdtrainError, match="no such file"):
        train(quiet_config(CONFIG, tmp_path / "c", f"checkpoint.resume={tmp_path}/nope.ckpt"))


def test_sigusr1_checkpoints_at_a_step_boundary_and_resume_matches(tmp_path):
    common = [str(BIN / "hvdtrain"), "train", str(CONFIG), "train.epochs=30", "log.every_steps=5",
              "log.wandb=disabled"]
    straight = subprocess.run([*common, f"log.dir={tmp_path / 'a'}"], env=run_env(),
                              capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr
    proc = subprocess.Popen([*common, f"log.dir={tmp_path / 'b'}"], env=run_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # wait until training is under way
        if "step" in line and "epoch 1 " in line:
            break
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    assert "stopped on request at step" in err and "checkpoint.resume=auto" in err
    stopped_at = int(err.split("stopped on request at step ")[1].split(";")[0])
    # Agreed through the metrics allreduce started at a log step (every 5) and read one step later,
    # or at once at the epoch-end log (every 45 steps) and before a checkpoint (every 100).
    assert 45 < stopped_at < 1350 and ((stopped_at - 1) % 5 == 0 or stopped_at % 45 == 0
                                       or stopped_at % 100 == 0)
    assert not (tmp_path / "b" / "summary.json").exists()
    resumed = subprocess.run([*common, f"log.dir={tmp_path / 'b'}", "checkpoint.resume=auto"],
                             env=run_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    final_a = params_of(tmp_path / "a" / "checkpoints" / "step-00001350.ckpt")
    final_b = params_of(tmp_path / "b" / "checkpoints" / "step-00001350.ckpt")
    for key in final_a:
        assert torch.equal(final_a[key], final_b[key]), key
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["steps"] == 1350 and summary["final"]["eval_accuracy"] >= 0.95


def test_divergence_stops_naming_the_rank_and_the_first_bad_step(tmp_path):
    with pytest.raises(HvdtrainError, match=r"loss became NaN or infinite on rank 0 at step 13; "
                                            r"lower optim.lr"), pytest.warns(UserWarning):
        train(quiet_config(CONFIG, tmp_path, "model.name=tests.torch.user_models:NanOnRank",
                           "model.options={rank: 0, after: 12}", "checkpoint.every_steps=5"))
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [10, 20] and records[-1]["loss"] is None
    # The checkpoints due at steps 15 and 20 would hold NaN weights: they are not written.
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert names == ["step-00000005.ckpt", "step-00000010.ckpt"]


@pytest.mark.timeout(600)
def test_soak_kills_the_writer_mid_save_and_the_newest_valid_checkpoint_loads():
    """A few trials of scripts/soak_checkpoint.py (20 by default): SIGKILL at random moments while
    checkpointing every step; the newest valid checkpoint loads, truncated and bit-flipped ones are
    skipped."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak_checkpoint.py"), "--trials",
                           "3", "--seed", "1"], env=run_env(), capture_output=True, text=True,
                          timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])["summary"]
    assert summary == {**summary, "trials": 3, "completed": 3, "hangs": 0}
    assert summary["fallback_checked"] == 3


def test_a_checkpoint_of_another_optimizer_is_refused_in_one_line(tmp_path):
    """An AdamW checkpoint resumed by an SGD run would give SGD Adam's param groups (its step then
    fails on a missing ``momentum``): refused before training, naming both."""
    train(quiet_config(CONFIG, tmp_path, "optim.name=adamw", "train.max_steps=3"))
    with pytest.raises(HvdtrainError, match=r"holds the state of optim.name='adamw', this run "
                                            r"has optim.name='sgd'"):
        train(quiet_config(CONFIG, tmp_path, "optim.name=sgd", "train.max_steps=6",
                           "checkpoint.resume=auto"))
