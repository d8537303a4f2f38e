"""Sharded data parallel at stage 1 in TensorFlow (``shard.stage=1``): at 2 ranks the sharded
update trains as the ring does, with SGD with momentum and with Adam and weight decay, its
checkpoint resumes exactly at the same world size, and fp16 on the reduce-scatter halves its
bytes.

One launch under Gloo (-np 2): the ring and the sharded update with SGD with momentum (1 epoch,
global batch 32), the same with Adam and weight decay (2 epochs, a checkpoint every 20 steps),
the sharded Adam run resumed from its step-60 checkpoint, and fp16 on the wire. The 9,610
parameters travel in 8 KiB rounds (three a step). Under MPI, one launch of the SGD pair, `long`:
make test's MPI launch of TensorFlow's sharding (test_tf_shard2.py) trains stage 1 beside the
ring and stage 2.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.conftest import assert_accuracy_near, assert_loss_near, read_jsonl
from tests.multirank.conftest import Launch, launch_worker

SHARDED = "shard.stage=1,shard.chunk_kib=8"
SGD = "optim.name=sgd,optim.momentum=0.9,optim.lr=0.05,data.batch_size=16,train.epochs=1"
ADAM = ("optim.name=adam,optim.lr=0.002,optim.weight_decay=0.01,data.batch_size=16,"
        "train.epochs=2,checkpoint.every_steps=20")
PARAMETERS = 64 * 128 + 128 + 128 * 10 + 10
"""The digits MLP's parameters (hidden layer of 128)."""
TOLERANCE = 1e-6
"""The reduce-scatter's average against the ring's grouped allreduce: the same sum of two, in
float32 (equal to the bit where measured; one step more or less moves 1e-3 to 1e-2)."""


@pytest.fixture(scope="session")
def sharded_tf(tmp_path_factory) -> Callable[[str], Launch]:
    """``sharded_tf(controller)``: the launch described in the module docstring, once."""
    cache: dict[str, Launch] = {}

    def get(controller: str) -> Launch:
        if controller not in cache:
            out = tmp_path_factory.mktemp(f"shard-tf-{controller}")
            runs = [f"ring_sgd:{SGD}", f"shard_sgd:{SGD},{SHARDED}"]
            if controller == "gloo":
                saved = out / "shard_adam" / "checkpoints" / "step-00000060.ckpt"
                runs += [f"ring_adam:{ADAM}", f"shard_adam:{ADAM},{SHARDED}",
                         f"shard_adam_resumed:{ADAM},{SHARDED},checkpoint.resume={saved}",
                         f"fp16:{SGD},{SHARDED},comm.compression=fp16"]
            cache[controller] = launch_worker(2, controller, "tensorflow", out, runs)
        return cache[controller]

    return get


def assert_near(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert got.keys() == want.keys() and len(got) == 4, what
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=TOLERANCE, err_msg=what)


@pytest.mark.parametrize("controller", ["gloo", pytest.param("mpi", marks=pytest.mark.long)])
def test_two_ranks_with_sgd_momentum_equal_the_ring(sharded_tf, controller):
    launch = sharded_tf(controller)
    p0, p1 = (launch.rank("shard_sgd", r)[0] for r in (0, 1))
    for key in p0:  # the all-gather gives every rank every shard
        assert np.array_equal(p0[key], p1[key]), key
    assert_near(p0, launch.rank("ring_sgd", 0)[0], f"SGD sharded against the ring ({controller})")
    summary = launch.summary("shard_sgd")
    assert summary["shard_stage"] == 1 and summary["shard_ranks"] == summary["world_size"] == 2
    # Per step: the whole gradient to reduce-scatter, the rank's shard of 4,805 to all-gather.
    logged = [r for r in read_jsonl(launch.out / "shard_sgd" / "metrics.jsonl")
              if "wire_bytes" in r]
    assert logged and {r["wire_bytes"] for r in logged} == {4 * PARAMETERS + 4 * PARAMETERS // 2}


def test_adam_equals_the_ring_and_resumes_its_checkpoint_exactly(sharded_tf):
    launch = sharded_tf("gloo")
    adam, _ = launch.rank("shard_adam", 0)
    assert_near(adam, launch.rank("ring_adam", 0)[0], "Adam sharded against the ring")
    for rank in (0, 1):
        resumed, _ = launch.rank("shard_adam_resumed", rank)
        for key in adam:  # the same world size: the very bits of the uninterrupted run
            assert np.array_equal(resumed[key], adam[key]), (rank, key)
    with np.load(launch.out / "shard_adam" / "checkpoints" / "step-00000060.ckpt") as npz:
        slots = [npz[k] for k in npz.files if k.startswith("optimizer/") and npz[k].ndim == 1]
    # Adam's two moments (the optimizer's variables 2 and 3, after its step count and rate) are
    # in the ranks' parts, each rank's shard of each (4,805 elements).
    assert [s.shape for s in slots] == [(0,), (0,)]
    parts = sorted((launch.out / "shard_adam" / "checkpoints").glob("step-00000060.rank-*.part"))
    assert [{k: v.shape for k, v in load_file(str(p)).items()} for p in parts] == [
        {"u0.s2": (PARAMETERS // 2,), "u0.s3": (PARAMETERS // 2,)}] * 2


def test_fp16_on_the_reduce_scatter_halves_its_bytes_and_stays_near(sharded_tf):
    launch = sharded_tf("gloo")
    fp16, fp32 = launch.summary("fp16")["final"], launch.summary("shard_sgd")["final"]
    assert_accuracy_near(fp16["eval_accuracy"], fp32["eval_accuracy"], "sharded with fp16")
    assert_loss_near(fp16["eval_loss"], fp32["eval_loss"], "sharded with fp16")
    logged = [r for r in read_jsonl(launch.out / "fp16" / "metrics.jsonl") if "wire_bytes" in r]
    assert logged and {r["wire_bytes"] for r in logged} == {2 * PARAMETERS + 4 * PARAMETERS // 2}
