"""Sharded data parallel at stage 2 in TensorFlow (``shard.stage=2``): at 2 ranks the gradients,
reduce-scattered by layer inside the backward pass and accumulated as shards, train as the ring
does, and the checkpoints resume at stage 1 and at another number of ranks.

One launch under Gloo (-np 2, 2 micro-batches a step of 8 samples a rank, global batch 32): the
ring and stage 2 with Adam and weight decay (2 epochs, a checkpoint every 20 steps), stage 1
resumed from stage 2's step-60 checkpoint, the ring and stage 2 with AdamW (1 epoch), and SGD
with momentum at stage 2, and clipped by global norm on the ring and at stage 2. Under
MPI, one launch of the ring and stages 1 and 2 with SGD with momentum (make test's MPI rows of
TensorFlow's sharding, stage 1's too: test_shard_tf.py's own MPI launch is `long`). In make
test-long, one rank
(batch 16, the same global batch) resumes stage 2's step-60 checkpoint at stage 2.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.conftest import read_jsonl
from tests.multirank.conftest import Launch, launch_worker

STAGE2 = "shard.stage=2,shard.unit_kib=16"  # 4,096 elements: each of the 2 layers a group
STEP = "data.batch_size={b},train.backward_passes_per_step=2,optim.lr={lr},train.epochs={e}"
ADAM = "optim.name=adam,optim.weight_decay=0.01,checkpoint.every_steps=20"
ADAMW = "optim.name=adamw,optim.weight_decay=0.05"
SGD = "optim.name=sgd,optim.momentum=0.9"
CLIP = "optim.clip_norm=0.3"
PARAMETERS = 64 * 128 + 128 + 128 * 10 + 10
"""The digits MLP's parameters (hidden layer of 128): units of 8,320 and 1,290 elements."""
TOLERANCE = 1e-5
"""Stage 2 sums the micro-batches' averages where the ring averages their sum: float rounding
(measured 1.4e-7 after 90 Adam steps); one step more or less moves 1e-3 to 1e-2."""


def step(ranks: int, epochs: int, lr: float) -> str:
    """2 micro-batches a step of a global batch of 32 at ``ranks`` ranks; ``lr``: the rate at 2
    ranks (``optim.scale_lr`` multiplies it by the ranks)."""
    return STEP.format(b=16 // ranks, lr=lr * 2 / ranks, e=epochs)


def checkpoint(launch: Launch, name: str, at: int) -> Path:
    return launch.out / name / "checkpoints" / f"step-{at:08d}.ckpt"


@pytest.fixture(scope="session")
def stage2(tmp_path_factory) -> Callable[[str], Launch]:
    """``stage2(controller)``: the launch the module docstring describes (``one``: the one-rank
    resume), once."""
    cache: dict[str, Launch] = {}

    def get(which: str) -> Launch:
        if which not in cache:
            out = tmp_path_factory.mktemp(f"shard2-tf-{which}")
            adam, adamw = f"{step(2, 2, 0.001)},{ADAM}", f"{step(2, 1, 0.001)},{ADAMW}"
            ranks, controller = (1, "gloo") if which == "one" else (2, which)
            if which == "gloo":
                saved = checkpoint(Launch("tensorflow", which, out), "s2_adam", 60)
                sgd = f"{step(2, 1, 0.025)},{SGD}"
                runs = [f"ring_adam:{adam}", f"s2_adam:{adam},{STAGE2}",
                        f"s1_from_s2:{adam},shard.stage=1,checkpoint.resume={saved}",
                        f"ring_adamw:{adamw}", f"s2_adamw:{adamw},{STAGE2}",
                        f"s2_sgd:{sgd},{STAGE2}", f"ring_clip:{sgd},{CLIP}",
                        f"s2_clip:{sgd},{CLIP},{STAGE2}"]
            elif which == "mpi":
                sgd = f"{step(2, 1, 0.025)},{SGD}"
                runs = [f"ring_sgd:{sgd}", f"s2_sgd:{sgd},{STAGE2}",
                        f"s1_sgd:{sgd},shard.stage=1,shard.chunk_kib=8"]
            else:
                saved = checkpoint(get("gloo"), "s2_adam", 60)
                runs = [f"one:{step(1, 2, 0.001)},{ADAM},{STAGE2},checkpoint.resume={saved}"]
            cache[which] = launch_worker(ranks, controller, "tensorflow", out, runs)
        return cache[which]

    return get


def assert_near(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str,
                atol: float = TOLERANCE) -> None:
    assert got.keys() == want.keys() and len(got) == 4, what
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=atol, err_msg=f"{what}: {key}")


def assert_ranks_agree(launch: Launch, run: str) -> dict[str, np.ndarray]:
    p0, p1 = (launch.rank(run, r)[0] for r in (0, 1))
    for key in p0:  # the all-gather gives every rank every slice
        assert np.array_equal(p0[key], p1[key]), (run, key)
    return p0


def test_stage2_equals_the_ring_clips_and_stage1_resumes_its_checkpoint(stage2):
    launch = stage2("gloo")
    adam = assert_ranks_agree(launch, "s2_adam")
    assert_near(adam, launch.rank("ring_adam", 0)[0], "Adam, decay, accumulation: stage 2")
    assert_near(assert_ranks_agree(launch, "s2_adamw"), launch.rank("ring_adamw", 0)[0],
                "AdamW, accumulation: stage 2")
    # The same flat slots as stage 1's: stage 1 goes on from stage 2's checkpoint.
    assert_near(launch.rank("s1_from_s2", 0)[0], adam, "stage 1 from stage 2's step 60")
    with np.load(checkpoint(launch, "s2_adam", 60)) as npz:
        slots = [npz[k].shape for k in npz.files if k.startswith("optimizer/") and npz[k].ndim == 1]
    assert slots == [(0,), (0,)]  # Adam's two moments are in the ranks' parts:
    parts = sorted(checkpoint(launch, "s2_adam", 60).parent.glob("step-00000060.rank-*.part"))
    # each rank's half of each variable (4,096 + 64 + 640 + 5), of each moment
    assert [sum(t.size for t in load_file(str(p)).values()) for p in parts] == [PARAMETERS] * 2
    summary = launch.summary("s2_adam")
    assert summary["shard_stage"] == 2 and summary["shard_ranks"] == summary["world_size"] == 2
    # A step: the whole gradient once per micro-batch, the rank's slices (half of each unit) once.
    logged = [r for r in read_jsonl(launch.out / "s2_adam" / "metrics.jsonl") if "wire_bytes" in r]
    assert logged and {r["wire_bytes"] for r in logged} == {2 * 4 * PARAMETERS + 4 * PARAMETERS // 2}
    # Clipping by the global norm, summed over the shards: the clipped ring's, far from unclipped.
    ring = launch.rank("ring_clip", 0)[0]
    assert_near(assert_ranks_agree(launch, "s2_clip"), ring, "clipped at 0.3: stage 2")
    free = launch.rank("s2_sgd", 0)[0]
    assert max(np.abs(ring[k] - free[k]).max() for k in ring) > 1e-2  # the clip bites


def test_stages_1_and_2_equal_the_ring_under_mpi(stage2):
    launch = stage2("mpi")
    ring = launch.rank("ring_sgd", 0)[0]
    for stage in (1, 2):
        run = f"s{stage}_sgd"
        assert_near(assert_ranks_agree(launch, run), ring,
                    f"SGD with momentum, accumulation: stage {stage} under MPI")
        summary = launch.summary(run)
        assert summary["shard_stage"] == stage
        assert summary["shard_ranks"] == summary["world_size"] == 2


@pytest.mark.long
def test_one_rank_resumes_a_two_rank_stage2_checkpoint(stage2):
    one, _ = stage2("one").rank("one", 0)
    assert_near(one, stage2("gloo").rank("s2_adam", 0)[0], "1 rank from 2 ranks' step 60")
