"""PyTorch's side of elastic mode: Horovod's torch collectives and the engine's adjustments."""

from __future__ import annotations

import horovod.torch as hvd

from hvdtrain.elastic import ElasticBackend
from hvdtrain.engine import Engine
from hvdtrain.torch import rng


def refresh(engine: Engine) -> None:
    """Reads the rank and sizes again after Horovod restarted at another world size."""
    engine.rank, engine.size = hvd.rank(), hvd.size()
    engine.local_rank, engine.local_size = hvd.local_rank(), hvd.local_size()


def set_accumulation(engine: Engine, passes: int) -> None:
    """Sets the backward passes that Horovod's optimizer accumulates before its allreduce."""
    optimizer = engine.optimizer  # type: ignore[attr-defined]
    if optimizer.backward_passes_per_step != passes:
        optimizer.set_backward_passes_per_step(passes)


def backend() -> ElasticBackend:
    """The collectives and adjustments that :mod:`hvdtrain.elastic` needs, for PyTorch."""
    return ElasticBackend(run=hvd.elastic.run, broadcast_object=hvd.broadcast_object,
                          allgather_object=hvd.allgather_object, rank=hvd.rank, refresh=refresh,
                          set_accumulation=set_accumulation, fork_rng=rng.fork)
