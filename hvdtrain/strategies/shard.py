"""``shard``: sharded data parallel (``shard.stage`` 1-3, docs/sharding.md): stage 1 shards the
optimizer state (reduce-scatter, update, allgather), stage 2 the gradients too, stage 3 the
parameters too. Its row of the compatibility table."""

from __future__ import annotations

from typing import Any

from hvdtrain.strategies.base import (
    DENSE,
    SPARSE,
    WHOLE,
    CheckpointLayout,
    ExchangeKind,
    Rule,
    Strategy,
    always,
)

ONE = {"shard.stage": 1}


def _given(cfg: Any) -> str:
    return f"shard.stage={cfg.shard.stage}"


def _compression(cfg: Any) -> str:
    return (f"comm.compression={cfg.comm.compression!r} with {_given(cfg)}: the sharded update's "
            "reduce-scatter carries none or fp16 only")


def _pipeline(cfg: Any) -> str:
    return (f"pipeline.stages={cfg.pipeline.stages} with {_given(cfg)} and "
            f"pipeline.schedule={cfg.pipeline.schedule!r}: its weight passes set the gradients "
            "apart from the backward pass that stages 2-3 reduce-scatter in; use another "
            "schedule or shard.stage=1")


def _split_weights(cfg: Any) -> bool:
    """A schedule whose weight gradients torch computes apart (zero bubble), which the
    post-accumulate-grad hooks of stages 2-3 never see."""
    return cfg.pipeline.schedule in ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


def _elastic(cfg: Any) -> str:
    return (f"elastic.enabled=true with {_given(cfg)} and shard.group='node': a reset changes "
            "the nodes' sizes, which the node's shards need equal; use shard.group=all")


def _tensorflow(cfg: Any) -> str:
    return ("framework='tensorflow' with shard.group='node': sharding within a node is built in "
            "PyTorch only so far; use shard.group=all")


RULES = (
    Rule("shard", "ps", lambda cfg: cfg.comm.topology != "ring",
         lambda cfg: f"comm.topology={cfg.comm.topology!r} with {_given(cfg)}: the sharded "
                     "update reduce-scatters among the workers, parameter servers sum on their "
                     "own; use comm.topology=ring",
         {**ONE, "comm.topology": "ps"}),
    Rule("shard", "pipeline",
         lambda cfg: cfg.pipeline.stages > 1 and cfg.shard.stage >= 2 and _split_weights(cfg),
         _pipeline, {"shard.stage": 2, "pipeline.stages": 2, "pipeline.virtual_stages": 2,
                     "pipeline.schedule": "interleaved_zero_bubble"},
         only="at stages 2-3 with a zero-bubble schedule"),
    Rule("shard", "pipeline", lambda cfg: cfg.pipeline.stages > 1 and cfg.shard.group == "node",
         lambda cfg: f"pipeline.stages={cfg.pipeline.stages} with shard.group='node': a "
                     "stage's shards within a node are not built; use shard.group=all",
         {**ONE, "shard.group": "node", "pipeline.stages": 2}, only="with shard.group=node"),
    Rule("shard", "sparse compression", lambda cfg: cfg.comm.compression in SPARSE, _compression,
         {**ONE, "comm.compression": "topk"}),
    Rule("shard", "powersgd",
         lambda cfg: cfg.comm.compression not in (*DENSE, *SPARSE), _compression,
         {**ONE, "comm.compression": "powersgd"}),
    Rule("shard", "elastic", lambda cfg: cfg.elastic.enabled and cfg.shard.group == "node",
         _elastic, {**ONE, "elastic.enabled": True, "shard.group": "node"},
         only="with shard.group=node"),
    Rule("shard", "tensorflow", lambda cfg: cfg.framework == "tensorflow"
         and cfg.shard.group == "node", _tensorflow,
         {**ONE, "shard.group": "node", "framework": "tensorflow"}, only="with shard.group=node"),
)

STRATEGY = Strategy(
    name="shard",
    summary="sharded data parallel: the optimizer state (`shard.stage=1`), the gradients too "
            "(2) or the parameters too (3) sharded over the data-parallel copies",
    active=lambda cfg: cfg.shard.stage >= 1,
    rules=RULES,
    # PyTorch's stages are its exchange's (torch/exchange.make_exchange), on the ring's engine.
    engines={"tensorflow": "hvdtrain.tensorflow.shard:ShardedEngine"},
    exchanges=(ExchangeKind("sharded", always, {
        "torch": "hvdtrain.torch.exchange:sharded_exchange",
        "torch.stage": "hvdtrain.torch.stages:stage_sharded",
        "tensorflow.stage": "hvdtrain.tensorflow.stages:stage_sharded"}),),
    checkpoint=CheckpointLayout(WHOLE, "rank 0", "every rank's shard of the optimizer state", True),
    cost="hvdtrain.plan.predict:sharded",
)
