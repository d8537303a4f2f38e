"""TensorFlow's side of :mod:`hvdtrain.frameworks`: each role's module or class, typed as its
protocol, so that mypy checks this package against the contract (and the tests import it)."""

from __future__ import annotations

from hvdtrain import frameworks
from hvdtrain.tensorflow import collectives, exchange, pipeline, plan_profile, stages
from hvdtrain.tensorflow.collectives import TensorFlowCollectives
from hvdtrain.tensorflow.engine import TensorFlowEngine
from hvdtrain.tensorflow.shard import ShardedEngine

ENGINES: tuple[frameworks.EngineClass, ...] = (TensorFlowEngine, pipeline.PipelineEngine,
                                               ShardedEngine)
EXCHANGE: frameworks.ExchangeParts = exchange
FACTORIES: tuple[frameworks.ExchangeFactory, ...] = (
    exchange.dense_exchange, exchange.compressing_exchange, exchange.ps_exchange,
    pipeline.stage_exchange, stages.stage_sharded)
STAGES: frameworks.StageParts = pipeline
KERNELS: frameworks.Kernels = collectives
COLLECTIVES: frameworks.CollectivesClass = TensorFlowCollectives
PROFILER: frameworks.Profiler = plan_profile
