"""fp16 loss scaling at every ``shard.stage``: the ranks decide together whether a step's gradient
overflowed, so that every rank skips it and lowers the loss scale, or none does, as the ring's
loss scaler decides on the whole averaged gradient.

One launch per framework, 2 ranks under Gloo (PyTorch under MPI too, ``long``), one epoch of
the digits MLP (23 steps of 2 micro-batches of 16 a rank), Adam with weight decay,
``train.precision=fp16`` starting from a loss scale of 2**24, which overflows float16 in the
first steps (seen on 2026-12-06: 6 steps skipped in both frameworks, the scale down to 2**18):
the ring and stages 1, 2 and 3 in PyTorch
(with the gradient clipped by global norm, after unscaling), the ring and stages 1 and 2 in
TensorFlow (which refuses clipping under fp16). Each stage's parameters equal the fp16 ring's
within 1e-5 (seen: 2.2e-8 in PyTorch, whose clipping norm sums the shards; to the bit in
TensorFlow), and every rank ends with the ring's loss scale and count of skipped steps. A run
resumed from a step-12 checkpoint (PyTorch: stage 3 from the ring's; TensorFlow: stage 1 from
its own) goes on on every rank from the scale rank 0 restored (2**18, not the first 2**24), to
the ring's end.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import horovodrun
from tests.multirank.conftest import CONFIGS, PYTHON

WORKER = str(Path(__file__).with_name("worker.py"))
START = 2.0 ** 24
"""The first loss scale: float16 overflows under it until the scaler has halved it a few times."""
FP16 = ("data.batch_size=16,train.backward_passes_per_step=2,train.epochs=1,optim.warmup_steps=0,"
        "optim.name=adam,optim.lr=0.002,optim.weight_decay=0.01,train.precision=fp16,"
        f"train.loss_scale={START:.0f},checkpoint.every_steps=12")
CLIP = ",optim.clip_norm=0.1"
"""PyTorch only: TensorFlow refuses clipping under fp16 (its update sees scaled gradients). It
clips (seen: the clipped ring ends 0.04 from the unclipped one; at 1.0 it would not clip)."""
STAGES = {"torch": (1, 2, 3), "tensorflow": (1, 2)}
TOLERANCE = 1e-5
"""As the fp32 stages against the ring (tests/multirank/test_shard_units.py): the reduce-scatter
averages each micro-batch before the sum, where the ring sums and then averages."""


def launch(out: Path, framework: str, controller: str) -> Path:
    settings = FP16 + (CLIP if framework == "torch" else "")
    runs = [f"ring:{settings}", *(f"s{k}:{settings},shard.stage={k}" for k in STAGES[framework])]
    # Resumed at step 12: PyTorch's stage 3 from the ring, TensorFlow's stage 1 from its own
    # (its sharded checkpoints and the ring's do not resume each other).
    source, stage = ("ring", 3) if framework == "torch" else ("s1", 1)
    resume = out / source / "checkpoints" / "step-00000012.ckpt"
    runs.append(f"resumed:{settings},shard.stage={stage},checkpoint.resume={resume}")
    proc = horovodrun(2, controller, [PYTHON, WORKER, str(out), str(CONFIGS[framework]), *runs],
                      timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def rank(out: Path, run: str, r: int) -> tuple[dict[str, np.ndarray], dict]:
    with np.load(out / run / f"rank{r}.npz") as npz:
        params = dict(npz)
    record = json.loads((out / run / f"rank{r}.json").read_text())
    return params, {"loss_scale": record["loss_scale"],
                    **{key: record["summary"][key] for key in ("skipped_steps", "steps")}}


@pytest.mark.parametrize(("framework", "controller"), [
    ("torch", "gloo"), pytest.param("torch", "mpi", marks=pytest.mark.long),
    pytest.param("tensorflow", "gloo", marks=pytest.mark.long)])
def test_fp16_stages_skip_and_scale_as_the_fp16_ring(tmp_path, framework, controller):
    out = launch(tmp_path, framework, controller)
    ring, ring_record = rank(out, "ring", 0)
    # The run overflowed and skipped steps: the agreement was exercised, and the scale fell.
    assert ring_record["skipped_steps"] >= 1, ring_record
    assert ring_record["loss_scale"] < START, ring_record
    for run in ["ring", *(f"s{k}" for k in STAGES[framework])]:
        for r in (0, 1):
            params, record = rank(out, run, r)
            where = f"{framework} {run} rank {r}"
            assert record == ring_record, where  # the same skipped steps, the same final scale
            assert params.keys() == ring.keys() and len(ring) == 4, where
            for key in ring:
                np.testing.assert_allclose(params[key], ring[key], atol=TOLERANCE, rtol=0,
                                           err_msg=f"{where} {key}")
    for r in (0, 1):  # resumed at step 12 with the scale the ring had then, on every rank
        params, record = rank(out, "resumed", r)
        assert record["loss_scale"] == ring_record["loss_scale"], f"resumed rank {r}: {record}"
        assert record["skipped_steps"] == 0, f"resumed rank {r}: {record}"  # all before step 12
        for key in ring:
            np.testing.assert_allclose(params[key], ring[key], atol=TOLERANCE, rtol=0,
                                       err_msg=f"{framework} resumed rank {r} {key}")
