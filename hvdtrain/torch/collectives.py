"""Horovod's PyTorch collectives behind :class:`hvdtrain.engine.Collectives`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import horovod.torch as hvd
import torch

from hvdtrain.engine import HorovodCollectives


class TorchCollectives(HorovodCollectives):
    """``horovod.torch``'s collectives; see :class:`hvdtrain.engine.Collectives`."""

    def __init__(self) -> None:
        super().__init__(hvd)

    def start_allreduce_sums(self, sums: dict[str, float]) -> Callable[[], dict[str, float]]:
        keys = sorted(sums)
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        handle = hvd.allreduce_async(values, op=hvd.Sum, name="hvdtrain.sums")
        return lambda: dict(zip(keys, hvd.synchronize(handle).tolist(), strict=True))

    def elastic_run(self, func: Callable[..., Any]) -> Callable[..., Any]:
        return hvd.elastic.run(func)


def any_rank(flag: bool, process_set: Any = None) -> bool:
    """Whether ``flag`` is true on any rank (of ``process_set``; default every rank): one small
    allreduce."""
    group = hvd.global_process_set if process_set is None else process_set
    total = hvd.allreduce(torch.tensor([float(flag)]), op=hvd.Sum, name="hvdtrain.any_rank",
                          process_set=group)
    return float(total) > 0


_PROCESS_SETS: dict[tuple[int, ...], Any] = {}
"""Horovod process sets by their ranks: made once per process (a second training in the same
process reuses them; Horovod refuses a duplicate)."""


def process_set(ranks: Sequence[int]) -> Any:
    """Horovod's process set of ``ranks`` (Horovod started with dynamic process sets), made on
    first use; every rank must ask for every set in the same order. Pipeline stages' sets and
    shard.group=node's come from here, so that one process's trainings share them."""
    key = tuple(ranks)
    if key not in _PROCESS_SETS:
        _PROCESS_SETS[key] = hvd.add_process_set(list(key))
    return _PROCESS_SETS[key]
