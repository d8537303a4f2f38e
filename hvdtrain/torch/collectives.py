"""Horovod's PyTorch collectives behind :class:`hvdtrain.engine.Collectives`."""

from __future__ import annotations

from typing import Any, Callable

import horovod.torch as hvd
import torch

from hvdtrain.engine import Collectives


class TorchCollectives(Collectives):
    """``horovod.torch``'s collectives; see :class:`hvdtrain.engine.Collectives`."""

    def rank(self) -> int:
        return hvd.rank()

    def size(self) -> int:
        return hvd.size()

    def local_rank(self) -> int:
        return hvd.local_rank()

    def local_size(self) -> int:
        return hvd.local_size()

    def start_allreduce_sums(self, sums: dict[str, float]) -> Callable[[], dict[str, float]]:
        keys = sorted(sums)
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        handle = hvd.allreduce_async(values, op=hvd.Sum, name="hvdtrain.sums")
        return lambda: dict(zip(keys, hvd.synchronize(handle).tolist()))

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        return hvd.broadcast_object(obj, root_rank=root_rank)

    def allgather_object(self, obj: Any) -> list[Any]:
        return hvd.allgather_object(obj)

    def elastic_run(self, func: Callable[..., Any]) -> Callable[..., Any]:
        return hvd.elastic.run(func)
