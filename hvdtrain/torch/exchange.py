"""The gradient exchanges of :mod:`hvdtrain.exchange` for PyTorch: one factory per kind (the
strategies' registry names which a run gets), :func:`make_exchange` the look-up.

``dense`` is Horovod's ``DistributedOptimizer``: its backward hooks start each gradient's
allreduce as soon as the backward pass has produced it, overlapping communication with
computation; :meth:`DenseAllreduce.run` waits for them. ``compressing`` is
:class:`hvdtrain.torch.compression.CompressingExchange`, run once per step after the micro-batches.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import horovod.torch as hvd
import torch

from hvdtrain.compression import PLANS
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import (
    Exchanged,
    ExchangeRequest,
    GradientExchange,
    build_exchange,
    empty_stats,
)
from hvdtrain.layout import Layout
from hvdtrain.ps.exchange import ServerOptimizer, make_client
from hvdtrain.ps.layout import chunk_elements
from hvdtrain.torch.collectives import any_rank, process_set
from hvdtrain.torch.compression import make_compressing, optimizer_settings, with_optimizer
from hvdtrain.torch.ps import ServerSide, TorchAsyncPSExchange, TorchPSExchange
from hvdtrain.torch.shard import make_sharded
from hvdtrain.torch.shard_units import make_unit_sharded

_HOROVOD = {"float32": hvd.Compression.none, "float16": hvd.Compression.fp16}


def horovod_compression(method: str) -> Any | None:
    """Horovod's compressor for a method whose plan sends every tensor dense (``none``, ``fp16``),
    which Horovod's DistributedOptimizer then carries; None for the others."""
    plan = PLANS.get(method)
    return _HOROVOD[plan.dense_dtype] if plan.dense else None


def bytes_per_step(compression: Any, params: Iterable[torch.nn.Parameter]) -> tuple[int, int]:
    """The (wire, dense) bytes Horovod's DistributedOptimizer allreduces in every step with
    ``compression``. It sends each parameter that requires a gradient once a step (zeros for one
    the step did not reach), so the count is fixed: made once here, not by the step."""
    wire = dense = 0
    for p in params:
        if p.requires_grad:
            sent, _ = compression.compress(p.detach())
            wire += sent.numel() * sent.element_size()
            dense += p.numel() * p.element_size()
    return wire, dense


class DenseAllreduce(GradientExchange):
    """Horovod's ``DistributedOptimizer`` around the run's optimizer, as a gradient exchange."""

    def __init__(self, method: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 rank: int, size: int, accumulation: int) -> None:
        self.rank, self.size = rank, size
        compression = horovod_compression(method)
        self.optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compression,
            backward_passes_per_step=accumulation)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # None are allreduced at one rank outside elastic mode, where Horovod registers no hooks.
        self._bytes = bytes_per_step(compression, self.optimizer._requires_update)
        self.stats = empty_stats()

    def run(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        waited = time.perf_counter()
        self.optimizer.synchronize()  # in place: the parameters' gradients are now the averages
        wire, dense = self._bytes
        self.stats = {"wire_bytes": float(wire), "dense_bytes": float(dense),
                      "comm_s": time.perf_counter() - waited, "compress_s": 0.0}
        # Every parameter has one (TorchKernels.gradients); update() zips them strictly.
        return [p.grad for p in self.params if p.grad is not None]

    def any_rank(self, flag: bool) -> bool:
        return any_rank(flag)

    def updating(self) -> AbstractContextManager[Any]:
        return self.optimizer.skip_synchronize()

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        self.rank, self.size = rank, size
        if self.optimizer.backward_passes_per_step != accumulation:
            self.optimizer.set_backward_passes_per_step(accumulation)


def async_ps(client: Any, rank: int, size: int, params: Sequence[torch.nn.Parameter],
             optimizer: torch.optim.Optimizer) -> tuple[GradientExchange, torch.optim.Optimizer]:
    """The ``ssp``/``asp`` exchange and the do-nothing optimizer that replaces ``optimizer``,
    whose settings the servers' optimizer takes."""
    opt = optimizer_settings(optimizer)
    if opt is None:
        raise HvdtrainError(f"ps.consistency={client.consistency!r}: the servers run SGD, Adam "
                            f"or AdamW, not {type(optimizer).__name__}")
    server = ServerOptimizer(opt.name, opt.momentum, opt.weight_decay, (opt.beta1, opt.beta2),
                             opt.eps)
    worker = ServerSide(params, {**optimizer.defaults, "lr": optimizer.param_groups[0]["lr"]})
    return TorchAsyncPSExchange(client, rank, size, params, server, worker), worker


def make_exchange(cfg: Any, request: ExchangeRequest) -> Exchanged:
    """The run's exchange and the optimizer the step drives with it, built by the factory the
    strategies' registry names for ``cfg`` (:func:`hvdtrain.exchange.build_exchange`): one of
    the factories below, each for one kind."""
    return build_exchange(cfg, request)


def dense_exchange(r: ExchangeRequest) -> Exchanged:
    """``dense``: Horovod's ``DistributedOptimizer`` around the run's optimizer."""
    dense = DenseAllreduce(r.comm.compression, r.model, r.optimizer, r.rank, r.size,
                           r.accumulation)
    return dense, dense.optimizer


def compressing_exchange(r: ExchangeRequest) -> Exchanged:
    """``compressing``: the method's plan, and plain SGD where the exchange applies the
    optimizer's update rule itself (DGC, compressed Adam)."""
    compressing = make_compressing(r.comm, r.seed, r.rank, r.size, list(r.params),
                                   optimizer_settings(r.optimizer))
    return compressing, with_optimizer(compressing, r.optimizer)


def ps_exchange(r: ExchangeRequest) -> Exchanged:
    """``ps`` (``bsp``): push and pull through the servers; the run's optimizer steps."""
    assert r.ps is not None, "a parameter server exchange needs the ps section"
    client = make_client(r.ps, r.comm, [p.shape for p in r.params], r.seed)
    return TorchPSExchange(client, r.rank, r.size, list(r.params), r.ps.overlap), r.optimizer


def server_optimizer_exchange(r: ExchangeRequest) -> Exchanged:
    """``ps-optimizer`` (``ssp``, ``asp``): the servers run the optimizer; the step drives
    :class:`ServerSide`."""
    assert r.ps is not None, "a parameter server exchange needs the ps section"
    client = make_client(r.ps, r.comm, [p.shape for p in r.params], r.seed)
    return async_ps(client, r.rank, r.size, list(r.params), r.optimizer)


def sharded_exchange(r: ExchangeRequest) -> Exchanged:
    """``sharded``: the sharded optimizer in the optimizer's place, sharding over this rank's
    stage's copies of the job's layout: stage 1's of :mod:`hvdtrain.torch.shard`, stages 2-3's
    of :mod:`hvdtrain.torch.shard_units`."""
    assert r.shard is not None, "the sharded update needs the shard section"
    ranks = r.layout or Layout(r.size)
    rank, size = ranks.sharding(r.rank)
    group, replicas = hybrid_sets(ranks, r.rank) if ranks.shards > 1 else (None, None)
    if r.shard.stage >= 2:
        return make_unit_sharded(r.optimizer, r.model, rank, size, r.shard, r.comm.compression,
                                 r.accumulation, group, replicas)
    return make_sharded(r.optimizer, r.model, rank, size, chunk_elements(r.shard.chunk_kib),
                        r.comm.compression, group, replicas)


def hybrid_sets(layout: Layout, rank: int) -> tuple[Any, Any]:
    """``shard.group=node``: Horovod's process sets of ``rank``'s node (its shard group) and of
    the ranks holding its shard on the other nodes (None on a single node). Every rank makes
    every set, in the layout's order, as Horovod asks."""
    def made(ranks: list[int]) -> Any:
        whole = ranks == layout.worker_ranks()
        return hvd.global_process_set if whole else process_set(ranks)

    nodes = {tuple(g): made(g) for g in layout.shard_groups()}
    across = ({tuple(g): made(g) for g in layout.stage_groups()} if layout.copies > 1 else {})
    return (nodes[tuple(layout.sharding_ranks(rank))],
            across.get(tuple(layout.replica_ranks(rank))))
