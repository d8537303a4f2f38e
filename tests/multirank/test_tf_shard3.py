"""Sharded data parallel at stage 3 in TensorFlow (``shard.stage=3``): at 2 ranks under Gloo the
parameters, gathered per layer in the forward and again in the backward pass and reduce-scattered
inside it, train as the ring does; each rank keeps only its slices between steps, and the
checkpoints resume at stage 2 and stage 3 resumes stage 2's.

``make test``: one launch (-np 2, 2 micro-batches a step of 8 samples a rank, global batch 32,
45 steps): the ring and stage 3 with Adam and weight decay (a checkpoint every 20 steps), and
stage 2 resumed from stage 3's step-20 checkpoint; every log record of stage 3 has its wait for
the collectives (``comm_time_s``). ``make test-long``: one launch of SGD with
momentum clipped by global norm on the ring and at stage 3, AdamW on the ring and at stage 3
without prefetch and keeping the forward's gathered parameters
(``shard.reshard_after_forward=false``), stage 3 resumed from stage 2's step-20 checkpoint, and
SGD with fp16 loss scaling on the ring and at stage 3.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import read_jsonl
from tests.multirank.conftest import Launch, launch_worker

STAGE3 = "shard.stage=3,shard.unit_kib=16"  # 4,096 elements: each of the 2 layers a group
STEP = "data.batch_size=8,train.backward_passes_per_step=2,train.epochs=1,optim.lr={lr}"
ADAM = "optim.name=adam,optim.weight_decay=0.01,checkpoint.every_steps=20"
ADAMW = "optim.name=adamw,optim.weight_decay=0.05,checkpoint.every_steps=20"
SGD = "optim.name=sgd,optim.momentum=0.9,optim.clip_norm=0.3"
FP16 = (STEP.format(lr=0.025) + ",optim.name=sgd,optim.momentum=0.9,train.precision=fp16,"
        "train.loss_scale=16777216")  # 2**24: the first steps overflow
TOLERANCE = 1e-5
"""Stage 3 sums the micro-batches' averages where the ring averages their sum: float rounding
(seen 7.8e-8 after 45 Adam steps); one step more or less moves 1e-3 to 1e-2."""


def checkpoint(launch: Launch, name: str, at: int) -> Path:
    return launch.out / name / "checkpoints" / f"step-{at:08d}.ckpt"


@pytest.fixture(scope="session")
def stage3(tmp_path_factory) -> Callable[[str], Launch]:
    """``stage3(which)``: the ``make test`` launch (``short``) or the long one (``long``)."""
    cache: dict[str, Launch] = {}

    def get(which: str) -> Launch:
        if which not in cache:
            out = tmp_path_factory.mktemp(f"shard3-tf-{which}")
            adam = f"{STEP.format(lr=0.001)},{ADAM}"
            if which == "short":
                saved = checkpoint(Launch("tensorflow", "gloo", out), "s3_adam", 20)
                runs = [f"ring_adam:{adam}", f"s3_adam:{adam},{STAGE3}",
                        f"s2_from_s3:{adam},shard.stage=2,checkpoint.resume={saved}"]
            else:
                saved = checkpoint(Launch("tensorflow", "gloo", out), "s2_adamw", 20)
                sgd, adamw = f"{STEP.format(lr=0.025)},{SGD}", f"{STEP.format(lr=0.001)},{ADAMW}"
                runs = [f"ring_sgd:{sgd}", f"s3_sgd:{sgd},{STAGE3}", f"ring_adamw:{adamw}",
                        f"s3_adamw:{adamw},{STAGE3},shard.prefetch=0,"
                        "shard.reshard_after_forward=false",
                        f"s2_adamw:{adamw},shard.stage=2",
                        f"s3_from_s2:{adamw},{STAGE3},checkpoint.resume={saved}",
                        f"ring_fp16:{FP16}", f"s3_fp16:{FP16},{STAGE3}"]
            cache[which] = launch_worker(2, "gloo", "tensorflow", out, runs)
        return cache[which]

    return get


def assert_near(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert got.keys() == want.keys() and len(got) == 4, what
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=TOLERANCE,
                                   err_msg=f"{what}: {key}")


def assert_ranks_agree(launch: Launch, run: str) -> dict[str, np.ndarray]:
    p0, p1 = (launch.rank(run, r)[0] for r in (0, 1))
    for key in p0:  # every rank's slices gathered whole: the same on both
        assert np.array_equal(p0[key], p1[key]), (run, key)
    return p0


def test_stage3_equals_the_ring_and_stage2_resumes_its_checkpoint(stage3):
    launch = stage3("short")
    ring = launch.rank("ring_adam", 0)[0]
    adam = assert_ranks_agree(launch, "s3_adam")
    assert_near(adam, ring, "Adam, decay, accumulation: stage 3")
    assert max(np.abs(ring[k] - launch.rank("s2_from_s3", 0)[0][k]).max() for k in ring) < 1e-5
    with np.load(checkpoint(launch, "s3_adam", 20)) as npz:
        slots = [npz[k].shape for k in npz.files if k.startswith("optimizer/") and npz[k].ndim == 1]
        model = [npz[f"model/{i}"].shape for i in range(4)]
    assert slots == [(0,), (0,)]  # Adam's moments are in the ranks' parts, and so are the
    assert model == [(0,)] * 4  # parameters (test_tf_shard3_ckpt.py)
    summary = launch.summary("s3_adam")
    assert summary["shard_stage"] == 3 and summary["shard_ranks"] == summary["world_size"] == 2
    # Monitoring: the passes' waits for their gathers and reduce-scatters, every log record.
    logged = [r for r in read_jsonl(launch.out / "s3_adam" / "metrics.jsonl") if "wire_bytes" in r]
    assert logged and all(r["comm_time_s"] > 0 for r in logged)
    assert all(r["comm_time_s"] < r["step_time_s"] for r in logged)  # a part of a step
    # Every rank evaluated the same (its own batches): the summary's eval is the ring's.
    assert summary["final"]["eval_loss"] == pytest.approx(
        launch.summary("ring_adam")["final"]["eval_loss"], abs=1e-5)


@pytest.mark.long
def test_stage3_clips_and_resumes_stage2_without_prefetch_or_resharding(stage3):
    launch = stage3("long")
    clipped = assert_ranks_agree(launch, "s3_sgd")
    assert_near(clipped, launch.rank("ring_sgd", 0)[0], "SGD, clipped at 0.3: stage 3")
    adamw = launch.rank("ring_adamw", 0)[0]
    assert_near(assert_ranks_agree(launch, "s3_adamw"), adamw,
                "AdamW, prefetch 0, the forward's parameters kept: stage 3")
    assert_near(assert_ranks_agree(launch, "s3_from_s2"), adamw, "stage 3 from stage 2's step 20")
    # fp16 loss scaling: an overflow skips the step on every rank, as on the fp16 ring.
    assert_near(assert_ranks_agree(launch, "s3_fp16"), launch.rank("ring_fp16", 0)[0],
                "SGD, fp16 loss scaling: stage 3")
    skipped = launch.summary("ring_fp16")["skipped_steps"]
    assert skipped > 0 and launch.summary("s3_fp16")["skipped_steps"] == skipped
    assert {launch.rank("s3_fp16", r)[1]["loss_scale"] for r in (0, 1)} == {
        launch.rank("ring_fp16", 0)[1]["loss_scale"]}
