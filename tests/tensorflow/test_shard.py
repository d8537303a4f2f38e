"""Sharded data parallel in TensorFlow, in one process (Horovod size 1): at ``shard.stage=1`` SGD
with momentum and Adam with weight decay train as the ring does and a checkpoint resumes exactly
(and the ring's resumes at stage 1);
at ``shard.stage=2`` (gradients reduce-scattered by layer) Adam with weight decay and AdamW with
gradient accumulation train as the ring does, units and groups are cut as documented, and stage 1
resumes stage 2's checkpoint; ``optim.clip_norm`` clips stages 1 and 2 as the ring."""

from __future__ import annotations

import numpy as np
import pytest

from hvdtrain.driver import train
from hvdtrain.tensorflow.shard import ShardedEngine
from hvdtrain.tensorflow.shard_grads import UnitShard, layer_units, unit_groups
from tests.conftest import TF_CONFIG, quiet_config

SHARDED = ["shard.stage=1", "shard.chunk_kib=1"]  # 256-element rounds: several a step
SGD = ["optim.name=sgd", "optim.momentum=0.9", "optim.lr=0.05", "train.epochs=1"]
ADAM = ["optim.name=adam", "optim.lr=0.002", "optim.weight_decay=0.01", "train.epochs=2",
        "checkpoint.every_steps=20"]


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert len(got) == len(want) == 4, what
    for (gk, g), (wk, w) in zip(sorted(got.items()), sorted(want.items()), strict=True):
        assert gk.split(".")[0] == wk.split(".")[0], what
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6, err_msg=f"{what}: {gk}")


@pytest.mark.parametrize("optim", [SGD, ADAM], ids=["sgd-momentum", "adam-decay"])
def test_the_sharded_update_trains_as_the_ring(tmp_path, optim):
    ring = train(quiet_config(TF_CONFIG, tmp_path / "ring", *optim))
    sharded = train(quiet_config(TF_CONFIG, tmp_path / "shard", *optim, *SHARDED))
    assert isinstance(sharded.engine, ShardedEngine)
    assert_same(sharded.engine.parameters(), ring.engine.parameters(), "sharded against the ring")
    assert sharded.summary["shard_stage"] == 1 and sharded.summary["shard_ranks"] == 1


def test_a_sharded_checkpoint_resumes_exactly_and_a_ring_one_too(tmp_path):
    whole = train(quiet_config(TF_CONFIG, tmp_path / "whole", *ADAM, *SHARDED))
    saved = tmp_path / "whole" / "run" / "checkpoints" / "step-00000060.ckpt"
    resumed = train(quiet_config(TF_CONFIG, tmp_path / "resumed", *ADAM, *SHARDED,
                                 f"checkpoint.resume={saved}"))
    assert_same(resumed.engine.parameters(), whole.engine.parameters(), "resumed at step 60")
    ring = train(quiet_config(TF_CONFIG, tmp_path / "ring", *ADAM))
    ring_saved = tmp_path / "ring" / "run" / "checkpoints" / "step-00000060.ckpt"
    # The ring's slots, one per variable, are handed out a variable at a time (shard_whole.py).
    mixed = train(quiet_config(TF_CONFIG, tmp_path / "mixed", *ADAM, *SHARDED,
                               f"checkpoint.resume={ring_saved}"))
    assert_same(mixed.engine.parameters(), ring.engine.parameters(), "from the ring's step 60")


STAGE2 = ["shard.stage=2", "shard.unit_kib=4"]  # 1,024 elements: each layer a group of its own
ACCUMULATE = ["train.backward_passes_per_step=2", "data.batch_size=16"]
ADAMW = ["optim.name=adamw", "optim.lr=0.002", "optim.weight_decay=0.05", "train.epochs=1"]


@pytest.mark.parametrize("optim", [ADAM, pytest.param(ADAMW, marks=pytest.mark.long)],
                         ids=["adam-decay", "adamw"])  # AdamW at 2 ranks runs in make test
def test_stage2_with_accumulation_trains_as_the_ring(tmp_path, optim):
    ring = train(quiet_config(TF_CONFIG, tmp_path / "ring", *optim, *ACCUMULATE))
    sharded = train(quiet_config(TF_CONFIG, tmp_path / "s2", *optim, *ACCUMULATE, *STAGE2))
    assert isinstance(sharded.engine.shard, UnitShard)
    assert sharded.engine.shard.units == [[0, 1], [2, 3]]  # the MLP's two Dense layers
    assert sharded.engine.shard.groups == [[0], [1]]
    # One rank: the ring sums two micro-batches, stage 2 adds its shard to an accumulator.
    assert_same(sharded.engine.parameters(), ring.engine.parameters(), "stage 2 against the ring")
    assert sharded.summary["shard_stage"] == 2
    # Stage 1 goes on from stage 2's checkpoint: both keep each slot flat in the same order.
    if optim is ADAM:
        saved = tmp_path / "s2" / "run" / "checkpoints" / "step-00000060.ckpt"
        resumed = train(quiet_config(TF_CONFIG, tmp_path / "s1", *optim, *ACCUMULATE,
                                     "shard.stage=1", f"checkpoint.resume={saved}"))
        assert_same(resumed.engine.parameters(), sharded.engine.parameters(), "stage 1 from 2")


def test_units_are_layers_and_groups_hold_up_to_the_limit():
    import keras
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2),
                              keras.layers.Dense(5, use_bias=False)])
    variables = model.trainable_variables
    units = layer_units(model.layers, variables)
    assert units == [[0, 1], [2, 3], [4]]
    assert unit_groups([16, 10, 10], 20) == [[0], [1, 2]]  # 16 + 10 > 20: a new group
    assert unit_groups([30, 5], 20) == [[0], [1]]  # a unit above the limit is a group alone
    shard = UnitShard(variables, units, rank=0, size=1, limit=20)
    assert (shard.total, shard.own, shard.groups) == (16 + 10 + 10, 36, [[0], [1, 2]])
    whole = np.arange(36, dtype=np.float32)
    assert np.array_equal(shard.take(whole), whole)
    second = UnitShard(variables, units, rank=1, size=2, limit=20)  # split as Horovod splits
    assert second.sizes == [12, 4, 8, 2, 10] and second.own == 18
    assert second.bounds == [(6, 12), (2, 4), (4, 8), (1, 2), (5, 10)]
    assert np.array_equal(second.take(whole), np.r_[6:12, 14:16, 20:24, 25:26, 31:36])


CLIPPED = [*SGD, "optim.clip_norm=0.3"]


def test_clipping_by_global_norm_is_the_rings_at_stages_1_and_2(tmp_path):
    ring = train(quiet_config(TF_CONFIG, tmp_path / "ring", *CLIPPED))
    free = train(quiet_config(TF_CONFIG, tmp_path / "free", *SGD))
    for stage in (1, 2):
        sharded = train(quiet_config(TF_CONFIG, tmp_path / f"s{stage}", *CLIPPED,
                                     f"shard.stage={stage}"))
        assert_same(sharded.engine.parameters(), ring.engine.parameters(), f"stage {stage}")
    # The clip bites: the clipped ring ends far from the unclipped one.
    gaps = [np.abs(a - b).max() for a, b in zip(ring.engine.parameters().values(),
                                                free.engine.parameters().values(), strict=True)]
    assert max(gaps) > 1e-2
