"""Pipeline stages with sharded data parallel in the config: PyTorch's stages 1-3 compose (each
stage's copies shard that stage's optimizer state, and at 2-3 its gradients and parameters);
TensorFlow's stages 1-3 compose too; stages 2-3 with a zero-bubble schedule are refused with one
line. The runs themselves: tests/multirank/test_shard_pipe.py and test_tf_shard_pipe*.py."""

from __future__ import annotations

import pytest

from hvdtrain.config import load_config
from hvdtrain.errors import ConfigError
from hvdtrain.strategies.table import engine_path, exchange_path

PIPE = ["pipeline.stages=2", "pipeline.microbatches=4"]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_torch_stages_with_pipeline_stages_are_accepted_and_shard_within_each_stage(stage,
                                                                                    schedule):
    cfg = load_config(None, [*PIPE, f"shard.stage={stage}", f"pipeline.schedule={schedule}"],
                      environ={})
    assert (cfg.pipeline.stages, cfg.shard.stage) == (2, stage)
    assert engine_path(cfg) == "hvdtrain.torch.pipeline:PipelineEngine"
    assert exchange_path(cfg, stage=True) == "hvdtrain.torch.stages:stage_sharded"


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_tensorflow_stages_1_3_with_pipeline_stages_shard_within_each_stage(stage, schedule):
    cfg = load_config(None, [*PIPE, f"shard.stage={stage}", f"pipeline.schedule={schedule}",
                             "framework=tensorflow"], environ={})
    assert engine_path(cfg) == "hvdtrain.tensorflow.pipeline:PipelineEngine"
    assert exchange_path(cfg, stage=True) == "hvdtrain.tensorflow.stages:stage_sharded"


@pytest.mark.parametrize(("overrides", "message"), [
    (["shard.stage=2", "pipeline.schedule=interleaved_zero_bubble", "pipeline.virtual_stages=2"],
     "pipeline.stages=2 with shard.stage=2 and pipeline.schedule='interleaved_zero_bubble': its "
     "weight passes set the gradients apart from the backward pass that stages 2-3 "
     "reduce-scatter in; use another schedule or shard.stage=1"),
    (["shard.stage=3", "pipeline.schedule=interleaved_zero_bubble", "pipeline.virtual_stages=2"],
     "pipeline.stages=2 with shard.stage=3 and pipeline.schedule='interleaved_zero_bubble'"),
])
def test_what_pipeline_stages_do_not_shard_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [*PIPE, *overrides], environ={})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
