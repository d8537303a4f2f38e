"""Sharded data parallel at stages 2 and 3 (``shard.stage`` 2-3, PyTorch): each trains as the
ring does on the same global batch, with gradient accumulation and AdamW's weight decay, with and
without activation checkpointing, with the gradient clipped by global norm (summed over the
shards), and its checkpoints move between the ring and stage 3.

One launch under Gloo (-np 2): the ring with AdamW (2 micro-batches a step, one epoch of 23
steps, a checkpoint every 12), stages 2 and 3 with the same settings, stage 3 with activation
checkpointing, stage 3 resumed from the ring's step-12 checkpoint and the ring resumed from stage
3's, stages 2 and 3 with their collectives in pieces of 1 KiB a rank (``shard.piece_kib``); then
one epoch of SGD with momentum, unclipped and clipped (optim.clip_norm) on the ring and at stages
1-3. Under MPI (make test's MPI row of PyTorch's sharding) stages 1, 2 and 3 of the equivalence
run of test_engines.py (SGD with momentum), against the ring's run that test launches (stage 1's
MPI row of test_shard.py, which checks its checkpoint and bytes too, is ``long``). The rest is
marked ``long``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import horovodrun, read_jsonl
from tests.multirank.conftest import EQUIV, PYTHON, WORKER, Launch, launch_worker
from tests.text_data import LM_CONFIGS, docs_corpus

ADAMW = ("data.batch_size=16,train.backward_passes_per_step=2,train.epochs=1,optim.warmup_steps=0,"
         "optim.name=adamw,optim.lr=0.002,optim.weight_decay=0.01,checkpoint.every_steps=12")
SGD = ("data.batch_size=16,train.backward_passes_per_step=2,train.epochs=1,optim.warmup_steps=0,"
       "optim.lr=0.05")
CLIP = SGD + ",optim.clip_norm=0.3"
"""SGD with momentum, its gradient clipped to a global norm of 0.3 (the MLP's starts near 2)."""
PARAMETERS = 64 * 128 + 128 + 128 * 10 + 10
"""The digits MLP's parameters: units of 8,320 and 1,290 elements, halves of 4,160 and 645."""
TOLERANCE = 1e-5
"""The reduce-scatter averages each micro-batch before the sum, the ring sums and then averages
(seen: 3e-8 after 23 AdamW steps); one step more or less moves 1e-3 to 1e-2."""


def ckpt(launch_out: Path, run: str, step: int) -> Path:
    return launch_out / run / "checkpoints" / f"step-{step:08d}.ckpt"


@pytest.fixture(scope="session")
def units(tmp_path_factory) -> Callable[[str], Launch]:
    """``units(controller)``: the launch the module docstring describes; launched once."""
    cache: dict[str, Launch] = {}

    def get(controller: str) -> Launch:
        if controller not in cache:
            out = tmp_path_factory.mktemp(f"shard-units-{controller}")
            if controller == "mpi":
                equiv = EQUIV.format(b=16, lr=0.05)
                # stage 1 in test_shard.py's pieces (8 KiB): its allgather in three rounds
                runs = [f"s1:{equiv},shard.stage=1,shard.chunk_kib=8",
                        f"s2:{equiv},shard.stage=2", f"s3:{equiv},shard.stage=3"]
            else:
                runs = [f"ring:{ADAMW}", f"s2:{ADAMW},shard.stage=2", f"s3:{ADAMW},shard.stage=3",
                        f"s3_recompute:{ADAMW},shard.stage=3,model.activation_checkpointing=true",
                        f"s3_from_ring:{ADAMW},shard.stage=3,checkpoint.resume="
                        f"{ckpt(out, 'ring', 12)}",
                        f"ring_from_s3:{ADAMW},checkpoint.resume={ckpt(out, 's3', 12)}",
                        f"s2_pieces:{ADAMW},shard.stage=2,shard.piece_kib=1",
                        f"s3_pieces:{ADAMW},shard.stage=3,shard.piece_kib=1",
                        f"sgd:{SGD}", f"ring_clip:{CLIP}",
                        *(f"s{k}_clip:{CLIP},shard.stage={k}" for k in (1, 2, 3))]
            cache[controller] = launch_worker(2, controller, "torch", out, runs)
        return cache[controller]

    return get


def assert_near(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert got.keys() == want.keys() and len(got) == 4, what
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=TOLERANCE, rtol=0, err_msg=what)


def assert_ranks_agree(launch: Launch, run: str) -> dict[str, np.ndarray]:
    p0, p1 = launch.rank(run, 0)[0], launch.rank(run, 1)[0]
    for key in p0:  # every rank ends with the whole model, gathered from the shards
        assert np.array_equal(p0[key], p1[key]), f"{run}: rank 1 against rank 0 at {key}"
    return p0


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_stages_two_and_three_train_as_the_ring(units, two_ranks, controller):
    launch = units(controller)
    ring = (two_ranks("torch", "mpi").rank("equiv", 0)[0] if controller == "mpi"
            else launch.rank("ring", 0)[0])
    for run in ("s1", "s2", "s3") if controller == "mpi" else ("s2", "s3"):
        assert_near(assert_ranks_agree(launch, run), ring, f"stage {run[1]} against the ring")
        summary = launch.summary(run)
        assert summary["shard_stage"] == int(run[1]) and summary["shard_ranks"] == 2
    if controller == "mpi":
        # Stage 1 updates as the ring does, to the bit (as test_shard.py's Gloo row checks); per
        # step the whole gradient to reduce-scatter and the rank's shard of 4,805 to all-gather.
        s1 = launch.rank("s1", 0)[0]
        for key in ring:
            assert np.array_equal(s1[key], ring[key]), f"stage 1 against the ring at {key}"
        logged = [r for r in read_jsonl(launch.out / "s1" / "metrics.jsonl") if "wire_bytes" in r]
        assert logged and {r["wire_bytes"] for r in logged} == {4 * PARAMETERS + 2 * PARAMETERS}
        return
    # Clipping by global norm: over the shards, the ring's; and it clips (not the unclipped run).
    clipped = launch.rank("ring_clip", 0)[0]
    assert not np.allclose(clipped["1.weight"], launch.rank("sgd", 0)[0]["1.weight"], atol=1e-3)
    for k in (1, 2, 3):
        assert_near(assert_ranks_agree(launch, f"s{k}_clip"), clipped, f"stage {k} clipped")
    # Activation checkpointing recomputes each unit's activations to the same gradients.
    assert_near(assert_ranks_agree(launch, "s3_recompute"), launch.rank("s3", 0)[0],
                "stage 3 with activation checkpointing")
    # Per step (2 micro-batches): each one's whole gradient to reduce-scatter; the rank's
    # shards (4,160 + 645) to all-gather once at stage 2, before each forward and backward at 3.
    own = PARAMETERS // 2
    for run, gathers in (("s2", 1), ("s3", 4)):
        logged = [r for r in read_jsonl(launch.out / run / "metrics.jsonl") if "wire_bytes" in r]
        assert logged and {r["wire_bytes"] for r in logged} == {8 * PARAMETERS + 4 * gathers * own}


def test_collectives_in_pieces_give_the_same_bits(units):
    """shard.piece_kib=1: each unit's all-gathers and reduce-scatters in rounds of 256 elements
    a rank (17 and 3 of them) train to the very bits of one collective a unit."""
    launch = units("gloo")
    for run in ("s2", "s3"):
        whole, pieces = launch.rank(run, 0)[0], assert_ranks_agree(launch, f"{run}_pieces")
        assert whole.keys() == pieces.keys() and len(whole) == 4
        for key in whole:
            assert np.array_equal(whole[key], pieces[key]), f"{run} in pieces at {key}"


def test_checkpoints_move_between_the_ring_and_stage_three(units):
    launch = units("gloo")
    ring = launch.rank("ring", 0)[0]
    assert_near(assert_ranks_agree(launch, "s3_from_ring"), ring, "stage 3 from a ring checkpoint")
    assert_near(launch.rank("ring_from_s3", 0)[0], ring, "the ring from a stage-3 checkpoint")
    for run in ("s3_from_ring", "ring_from_s3"):  # resumed: the first 12 steps not run again
        assert min(r["step"] for r in read_jsonl(launch.out / run / "metrics.jsonl")) > 12, run


@pytest.mark.long
def test_the_gpt_trains_as_the_ring_at_stages_two_and_three(tmp_path_factory):
    """The built-in GPT (transformer blocks as units, built one at a time at stage 3) with
    dropout, AdamW, clipping and 2 micro-batches a step: stages 2 and 3 (with activation
    checkpointing, prefetch 2 and the parameters kept from forward to backward; and with each
    block cut into its linear layers and norms, shard.unit_kib=64) against the ring, 30 steps
    at 2 ranks under Gloo (seen: 6e-6)."""
    corpus = docs_corpus(tmp_path_factory.mktemp("text-shard") / "docs")
    gpt = (f"data.options.root={corpus},train.max_steps=30,train.backward_passes_per_step=2,"
           "optim.name=adamw,optim.weight_decay=0.01,model.options.dropout=0.1,"
           "optim.clip_norm=1.0")
    out = tmp_path_factory.mktemp("shard-units-gpt")
    proc = horovodrun(2, "gloo", [PYTHON, WORKER, str(out), str(LM_CONFIGS["torch"]),
                                  f"ring:{gpt}", f"s2:{gpt},shard.stage=2", f"s3:{gpt},shard.stage=3",
                                  f"s3_recompute:{gpt},shard.stage=3,shard.prefetch=2,"
                                  "shard.reshard_after_forward=false,"
                                  "model.activation_checkpointing=true",
                                  f"s3_cut:{gpt},shard.stage=3,shard.unit_kib=64"], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    launch = Launch("torch", "gloo", out)
    ring = launch.rank("ring", 0)[0]
    for run in ("s2", "s3", "s3_recompute", "s3_cut"):
        got = assert_ranks_agree(launch, run)
        assert got.keys() == ring.keys(), run
        for key in ring:
            np.testing.assert_allclose(got[key], ring[key], atol=1e-4, rtol=0, err_msg=run)
