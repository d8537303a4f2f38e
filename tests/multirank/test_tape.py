"""A user's own ``tf.GradientTape`` loop on :class:`hvdtrain.tensorflow.tape.TapeTrainer` at two
ranks (docs/own-loop.md): it ends with the parameters ``hvdtrain train`` reaches on the same
model, data and config, traced (``@trainer.function``) or eager, and its metrics reach the sinks
averaged over the ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from tests.conftest import TF_CONFIG, horovodrun

WORKER = str(Path(__file__).with_name("tape_worker.py"))
# Digits' 1,437 training samples in global batches of 2 ranks x 16 x 2 micro-batches: each epoch's
# last step holds 29 samples, so its second micro-batch is empty on both ranks and the first
# splits 15/14 (the loss weighting and the empty batch both count).
RUN = ["train.epochs=2", "train.backward_passes_per_step=2", "data.batch_size=16",
       "log.every_steps=4", "log.console=false", "log.wandb=disabled"]


def load(path: Path) -> list[np.ndarray]:
    with np.load(path) as saved:
        return [saved[k] for k in sorted(saved.files)]


def test_tape_loop_ends_with_the_parameters_of_hvdtrain_train(tmp_path):
    proc = horovodrun(2, "gloo", [sys.executable, WORKER, str(tmp_path), str(TF_CONFIG), *RUN],
                      timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        trained = load(tmp_path / f"train-rank{rank}.npz")
        assert [t.shape for t in trained] == [(64, 128), (128,), (128, 10), (10,)]
        for loop in ("loop", "eager"):
            looped = load(tmp_path / f"{loop}-rank{rank}.npz")
            assert [t.shape for t in looped] == [t.shape for t in trained]
            for i, (value, mine) in enumerate(zip(trained, looped, strict=True)):
                # Same update in the same order: equal up to the loss's reduction (sum x weight
                # in the trainer, mean x weight here) and where the allreduce runs.
                np.testing.assert_allclose(mine, value, rtol=0, atol=1e-5,
                                           err_msg=f"{loop} variable {i}")
            assert np.abs(looped[2]).max() > 0.3  # it trained (initial weights below ~0.09)
    assert json.loads((tmp_path / "loop-rank0.json").read_text()) == {"step": 46, "epoch": 2}
    records = [json.loads(line)
               for line in (tmp_path / "loop" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [23, 46] and records[1]["loss"] < records[0]["loss"]
