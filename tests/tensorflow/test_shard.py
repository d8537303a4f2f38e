"""The sharded update (``shard.stage=1``) in TensorFlow, in one process (Horovod size 1): SGD with
momentum and Adam with weight decay train as the ring does, and a checkpoint resumes exactly."""

from __future__ import annotations

import numpy as np
import pytest

from hvdtrain.driver import train
from hvdtrain.errors import HvdtrainError
from hvdtrain.tensorflow.shard import ShardedEngine
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


def test_a_sharded_checkpoint_resumes_exactly_and_a_ring_one_is_refused(tmp_path):
    whole = train(quiet_config(TF_CONFIG, tmp_path / "whole", *ADAM, *SHARDED))
    saved = tmp_path / "whole" / "run" / "checkpoints" / "step-00000060.ckpt"
    resumed = train(quiet_config(TF_CONFIG, tmp_path / "resumed", *ADAM, *SHARDED,
                                 f"checkpoint.resume={saved}"))
    assert_same(resumed.engine.parameters(), whole.engine.parameters(), "resumed at step 60")
    train(quiet_config(TF_CONFIG, tmp_path / "ring", *ADAM))
    ring_saved = tmp_path / "ring" / "run" / "checkpoints" / "step-00000060.ckpt"
    with pytest.raises(HvdtrainError, match=r"resumes from checkpoints of shard\.stage=1 only"):
        train(quiet_config(TF_CONFIG, tmp_path / "mixed", *ADAM, *SHARDED,
                           f"checkpoint.resume={ring_saved}"))
