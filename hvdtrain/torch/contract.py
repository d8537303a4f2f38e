"""PyTorch's side of :mod:`hvdtrain.frameworks`: each role's module or class, typed as its
protocol, so that mypy checks this package against the contract (and the tests import it)."""

from __future__ import annotations

from hvdtrain import frameworks
from hvdtrain.torch import collectives, exchange, plan_profile, stages
from hvdtrain.torch.collectives import TorchCollectives
from hvdtrain.torch.engine import TorchEngine
from hvdtrain.torch.pipeline import PipelineEngine

ENGINES: tuple[frameworks.EngineClass, ...] = (TorchEngine, PipelineEngine)
EXCHANGE: frameworks.ExchangeParts = exchange
FACTORIES: tuple[frameworks.ExchangeFactory, ...] = (
    exchange.dense_exchange, exchange.compressing_exchange, exchange.ps_exchange,
    exchange.server_optimizer_exchange, exchange.sharded_exchange,
    stages.stage_allreduce, stages.stage_compressing, stages.stage_sharded)
STAGES: frameworks.StageParts = stages
KERNELS: frameworks.Kernels = collectives
COLLECTIVES: frameworks.CollectivesClass = TorchCollectives
PROFILER: frameworks.Profiler = plan_profile
