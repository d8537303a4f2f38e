"""Pipeline stages with sharded data parallel in the config: PyTorch's stage 1 composes (each
stage's copies shard that stage's optimizer state), stages 2-3 and TensorFlow are refused with
one line. The runs themselves: tests/multirank/test_shard_pipe.py."""

from __future__ import annotations

import pytest

from hvdtrain.config import load_config
from hvdtrain.errors import ConfigError
from hvdtrain.strategies.table import engine_path, exchange_path

PIPE = ["pipeline.stages=2", "pipeline.microbatches=4"]


def test_torch_stage_one_with_pipeline_stages_is_accepted_and_shards_within_each_stage():
    cfg = load_config(None, [*PIPE, "shard.stage=1", "shard.chunk_kib=8"], environ={})
    assert (cfg.pipeline.stages, cfg.shard.stage) == (2, 1)
    assert engine_path(cfg) == "hvdtrain.torch.pipeline:PipelineEngine"
    assert exchange_path(cfg, stage=True) == "hvdtrain.torch.stages:stage_sharded"


@pytest.mark.parametrize(("overrides", "message"), [
    (["shard.stage=2"], "pipeline.stages=2 with shard.stage=2: a pipeline stage's copies shard "
                        "its optimizer state only (shard.stage=1); stages 2-3 hook the backward "
                        "pass, which the pipeline's schedule runs in its own pieces; use "
                        "shard.stage=1"),
    (["shard.stage=3"], "pipeline.stages=2 with shard.stage=3: a pipeline stage's copies shard "
                        "its optimizer state only"),
    (["shard.stage=1", "framework=tensorflow"],
     "pipeline.stages=2 with shard.stage=1 and framework='tensorflow': sharding a stage's copies "
     "is built in PyTorch only so far; use shard.stage=0 or framework=torch"),
])
def test_what_pipeline_stages_do_not_shard_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [*PIPE, *overrides], environ={})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
