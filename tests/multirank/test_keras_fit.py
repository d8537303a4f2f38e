"""Keras 3 ``model.fit`` with hvdtrain's callbacks at two ranks (:mod:`hvdtrain.tensorflow.fit`,
docs/own-loop.md): the ranks agree, the metrics are averaged, a stop by signal plus a resume
ends bit-identical to the uninterrupted run, and fit ends with the parameters of ``hvdtrain
train`` on the same model, data and config."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TF_CONFIG, horovodrun

WORKER = str(Path(__file__).with_name("keras_fit_worker.py"))
# 1,437 samples in global batches of 2 x 16: 45 steps an epoch, the last of 29 samples (15/14).
RUN = ["train.epochs=2", "data.batch_size=16", "log.every_steps=5", "log.console=false",
       "log.wandb=disabled"]


def launch(out: Path, *overrides: str, signal_at: int = 0, train_too: bool = False):
    out.mkdir(parents=True, exist_ok=True)
    saved = dict(os.environ)
    os.environ["HVDTRAIN_TEST_SIGNAL_AT"] = str(signal_at)
    os.environ["HVDTRAIN_TEST_TRAIN_TOO"] = "1" if train_too else "0"
    try:
        return horovodrun(2, "gloo", [sys.executable, WORKER, str(out), str(TF_CONFIG), *RUN,
                                      *overrides], timeout=900)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def weights(out: Path, rank: int, name: str = "fit") -> list[np.ndarray]:
    with np.load(out / f"{name}-rank{rank}.npz") as npz:
        return [npz[f"arr_{i}"] for i in range(len(npz.files))]


def test_fit_averages_metrics_and_resumes_bit_identical_after_a_stop(tmp_path):
    whole = launch(tmp_path / "whole")
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    ranks = [json.loads((tmp_path / "whole" / f"fit-rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["history"] == ranks[1]["history"]  # averaged over the ranks: equal on both
    assert ranks[0]["step"] == 90 and ranks[0]["history"]["accuracy"][-1] > 0.9
    for a, b in zip(weights(tmp_path / "whole", 0), weights(tmp_path / "whole", 1), strict=True):
        assert np.array_equal(a, b)  # one broadcast start, one averaged gradient a step
    records = [json.loads(line) for line in
               (tmp_path / "whole" / "fit" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["epoch"]) for r in records] == [(45, 1), (90, 2)]
    assert records[1]["loss"] == ranks[0]["history"]["loss"][1]

    # Both ranks signal themselves after step 22; they agree at the log interval (step 25),
    # checkpoint and exit 75; the resume continues inside the first epoch.
    stopped = launch(tmp_path / "stopped", signal_at=22)
    output = stopped.stdout + stopped.stderr
    assert "Exit code: 75" in output, output[-3000:]
    stops = re.findall(r"\[(\d)\]<stderr>:hvdtrain: stopped on request at step (\d+)", output)
    assert sorted(stops) == [("0", "25"), ("1", "25")], output[-3000:]
    resumed = launch(tmp_path / "stopped", "checkpoint.resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert json.loads((tmp_path / "stopped" / "fit-rank0.json").read_text())["step"] == 90
    for rank in (0, 1):
        for a, b in zip(weights(tmp_path / "whole", rank), weights(tmp_path / "stopped", rank),
                        strict=True):
            assert np.array_equal(a, b), f"rank {rank}: resumed weights differ"


@pytest.mark.long
def test_fit_ends_with_the_parameters_of_hvdtrain_train(tmp_path):
    # 40 steps of 2 x 16, all full: fit's optimizer averages each rank's mean gradient, which is
    # the trainer's weighted mean where the ranks' shares are equal (docs/own-loop.md).
    proc = launch(tmp_path, "train.max_steps=40", "train.epochs=1", train_too=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        trained, fitted = weights(tmp_path, rank, "train"), weights(tmp_path, rank)
        assert [t.shape for t in trained] == [t.shape for t in fitted] == \
            [(64, 128), (128,), (128, 10), (10,)]
        for i, (value, mine) in enumerate(zip(trained, fitted, strict=True)):
            # The same updates: equal up to the loss's reduction (sum x weight in the trainer,
            # Keras's mean here) and the allreduce (the trainer's fused one, Horovod's Keras one).
            np.testing.assert_allclose(mine, value, rtol=0, atol=1e-5, err_msg=f"variable {i}")
        assert np.abs(fitted[2] - weights(tmp_path, rank, "init")[2]).max() > 0.05  # it trained
