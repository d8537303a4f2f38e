"""Sharded data parallel at stage 1 (``shard.stage=1``, PyTorch): the sharded update trains as
the ring does, and its checkpoints move between the ring, the sharded update and other numbers
of ranks.

One launch by default: -np 2 under Gloo, with the equivalence run of test_engines.py (5 epochs,
2 micro-batches per step; SGD with momentum), Adam with weight decay on the ring and sharded
(2 epochs, a checkpoint every epoch), two resumed runs (the ring from the sharded run's
step-100 checkpoint, the sharded update from the Adam ring's step-23 checkpoint) and fp16 on the
wire. The 9,610
parameters in 8 KiB pieces (2,048 elements) come back from each rank's shard of 4,805 in three
allgather rounds. They are compared with the ring's run of test_engines.py, launched anyway.
Under MPI the sharded equivalence run alone for the first test, ``long`` with the rest of the MPI
launch and 4 ranks: make test trains stage 1 under MPI as the ring in test_shard_units.py's MPI
launch, beside stages 2 and 3.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from hvdtrain.torch.shard_files import sources, whole_optimizer
from tests.conftest import assert_accuracy_near, assert_loss_near, read_jsonl
from tests.multirank.conftest import EQUIV, Launch, launch_worker

SHARDED = "shard.stage=1,shard.chunk_kib=8"
ADAM = "optim.name=adam,optim.lr=0.002,optim.weight_decay=0.01,train.epochs=2,checkpoint.every_steps=23"
PARAMETERS = 64 * 128 + 128 + 128 * 10 + 10
"""The digits MLP's parameters (hidden layer of 128)."""
TOLERANCE = 1e-5
"""As test_ps.py: at 4 ranks the reduce-scatter may add in another order than the ring's
allreduce (measured 2.1e-7 after 115 steps); one step more or less moves 1e-3 to 1e-2."""


def run(ranks: int) -> str:
    """The equivalence run at ``ranks`` ranks (global batch 32)."""
    return EQUIV.format(b=32 // ranks, lr=0.1 / ranks)


def checkpoint(launch: Launch, name: str, step: int) -> Path:
    return launch.out / name / "checkpoints" / f"step-{step:08d}.ckpt"


@pytest.fixture(scope="session")
def sharded(tmp_path_factory) -> Callable[..., Launch]:
    """``sharded(controller, ranks, alone=False)``: the launch described in the module docstring
    at 2 ranks (``alone``: its sharded equivalence run only); at 4, the ring and sharded runs and
    the sharded update resumed from the 2-rank sharded run's step-100 checkpoint. Launched once
    and shared."""
    cache: dict[tuple[str, int, bool], Launch] = {}

    def get(controller: str, ranks: int, alone: bool = False) -> Launch:
        if (controller, ranks, False) in cache:  # the whole launch holds the run alone too
            return cache[controller, ranks, False]
        if (controller, ranks, alone) not in cache:
            out = tmp_path_factory.mktemp(f"shard-{controller}-{ranks}")
            runs = [f"shard:{run(ranks)},{SHARDED}"]
            if ranks == 2 and not alone:
                runs += [f"ring_from_shard:{run(2)},checkpoint.resume="
                         f"{out / 'shard' / 'checkpoints' / 'step-00000100.ckpt'}",
                         f"adam_ring:{run(2)},{ADAM}", f"adam_shard:{run(2)},{ADAM},{SHARDED}",
                         f"adam_shard_from_ring:{run(2)},{ADAM},{SHARDED},checkpoint.resume="
                         f"{out / 'adam_ring' / 'checkpoints' / 'step-00000023.ckpt'}",
                         f"fp16:{run(2)},{SHARDED},comm.compression=fp16"]
            elif ranks != 2:
                saved = checkpoint(get(controller, 2), "shard", 100)
                runs += [f"ring:{run(ranks)}", f"resumed:{run(ranks)},{SHARDED},"
                                              f"checkpoint.resume={saved}"]
            cache[controller, ranks, alone] = launch_worker(ranks, controller, "torch", out,
                                                            runs)
        return cache[controller, ranks, alone]

    return get


def assert_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str,
                 atol: float = 0.0) -> None:
    assert got.keys() == want.keys() and len(got) == 4, what
    for key in want:
        if atol:
            np.testing.assert_allclose(got[key], want[key], atol=atol, rtol=0, err_msg=what)
        else:
            assert np.array_equal(got[key], want[key]), f"{what}: {key}"


def optimizer_state(path: Path) -> dict:
    """The checkpoint's optimizer state in the ring's layout (a sharded run's assembled whole
    from its ranks' shard files)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    source = sources(state, path, str(path))
    return state["optimizer"] if source is None else whole_optimizer(source)


@pytest.mark.parametrize("controller", ["gloo", pytest.param("mpi", marks=pytest.mark.long)])
def test_two_ranks_equal_the_ring_bitwise_and_write_its_checkpoint(sharded, two_ranks,
                                                                   controller):
    # Under MPI the equivalence run alone; its launch is long (test_shard_units.py's MPI launch
    # trains stage 1 under MPI in make test).
    launch = sharded(controller, 2, alone=controller == "mpi")
    ring = two_ranks("torch", controller)
    p0, _ = launch.rank("shard", 0)
    p1, _ = launch.rank("shard", 1)
    assert_equal(p1, p0, "rank 1 against rank 0")  # the allgather gives every rank every shard
    assert_equal(p0, ring.rank("equiv", 0)[0], "sharded against the ring")
    # The optimizer state in the ring's layout, gathered from both shards: the ring's very bits.
    got = optimizer_state(checkpoint(launch, "shard", 100))
    want = optimizer_state(checkpoint(ring, "equiv", 100))
    assert got["param_groups"] == want["param_groups"] and got["state"].keys() == {0, 1, 2, 3}
    for index, entry in want["state"].items():
        assert torch.equal(got["state"][index]["momentum_buffer"], entry["momentum_buffer"])
    summary = launch.summary("shard")
    assert summary["shard_stage"] == 1 and "topology" not in summary
    assert summary["shard_ranks"] == summary["world_size"] == 2
    # Per step: the whole gradient to reduce-scatter, the rank's shard of 4,805 to allgather.
    logged = [r for r in read_jsonl(launch.out / "shard" / "metrics.jsonl") if "wire_bytes" in r]
    assert logged and {r["wire_bytes"] for r in logged} == {4 * PARAMETERS + 4 * PARAMETERS // 2}


@pytest.mark.parametrize("controller", ["gloo", pytest.param("mpi", marks=pytest.mark.long)])
def test_checkpoints_move_between_the_ring_and_the_sharded_update(sharded, controller):
    launch = sharded(controller, 2)
    whole, _ = launch.rank("shard", 0)
    assert_equal(launch.rank("ring_from_shard", 0)[0], whole, "the ring from a sharded checkpoint")
    adam, _ = launch.rank("adam_ring", 0)
    assert_equal(launch.rank("adam_shard", 0)[0], adam, "Adam sharded against the ring")
    assert_equal(launch.rank("adam_shard_from_ring", 0)[0], adam,
                 "Adam sharded from a ring checkpoint")
    state = optimizer_state(checkpoint(launch, "adam_shard", 46))["state"]
    assert {key for entry in state.values() for key in entry} == {"step", "exp_avg", "exp_avg_sq"}
    assert float(state[0]["step"]) == 47  # the ring's count: its zero-gradient step included


def test_fp16_on_the_wire_halves_the_reduce_scatter_and_stays_near(sharded):
    launch = sharded("gloo", 2)
    fp16, fp32 = launch.summary("fp16")["final"], launch.summary("shard")["final"]
    assert_accuracy_near(fp16["eval_accuracy"], fp32["eval_accuracy"], "sharded with fp16")
    assert_loss_near(fp16["eval_loss"], fp32["eval_loss"], "sharded with fp16")
    logged = [r for r in read_jsonl(launch.out / "fp16" / "metrics.jsonl") if "wire_bytes" in r]
    assert logged and {r["wire_bytes"] for r in logged} == {2 * PARAMETERS + 4 * PARAMETERS // 2}


@pytest.mark.long
def test_four_ranks_stay_near_the_ring_and_resume_a_two_rank_checkpoint(sharded):
    launch = sharded("gloo", 4)
    got = [launch.rank("shard", r)[0] for r in range(4)]
    for rank in (1, 2, 3):
        assert_equal(got[rank], got[0], f"rank {rank} against rank 0")
    assert_equal(got[0], launch.rank("ring", 0)[0], "4 ranks against the ring", TOLERANCE)
    two, _ = sharded("gloo", 2).rank("shard", 0)
    assert_equal(launch.rank("resumed", 0)[0], two, "a 2-rank checkpoint on 4 ranks", TOLERANCE)
