"""``optim.clip_norm``: accepted on PyTorch's ring and with sharded data parallel, refused in one
line where the update it clips is not built (its values: tests/multirank/test_shard_units.py)."""

from __future__ import annotations

import pytest

from hvdtrain.config import load_config
from hvdtrain.errors import ConfigError


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clipping_is_accepted_on_the_ring_and_at_every_stage(stage):
    cfg = load_config(None, ["optim.clip_norm=0.5", f"shard.stage={stage}",
                             "comm.compression=fp16"], environ={})
    assert (cfg.optim.clip_norm, cfg.shard.stage) == (0.5, stage)
    if stage < 3:  # TensorFlow: the ring and stages 1-2
        cfg = load_config(None, ["optim.clip_norm=0.5", f"shard.stage={stage}",
                                 "framework=tensorflow"], environ={})
        assert (cfg.optim.clip_norm, cfg.framework) == (0.5, "tensorflow")


@pytest.mark.parametrize(("overrides", "given"), [
    (["framework=tensorflow", "train.precision=fp16"],
     "train.precision='fp16' and framework='tensorflow'"),
    (["comm.compression=topk"], "comm.compression='topk'"),
    (["comm.topology=ps"], "comm.topology='ps'"),
    (["pipeline.stages=2"], "pipeline.stages=2"),
])
def test_clipping_is_refused_where_it_is_not_built(overrides, given):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["optim.clip_norm=0.5", *overrides], environ={})
    assert str(info.value) == (
        f"optim.clip_norm=0.5 with {given}: clipping by global norm is built for the ring "
        "(comm.compression none or fp16) and shard.stage only, in TensorFlow without fp16 loss "
        "scaling; leave optim.clip_norm at its default 0")
