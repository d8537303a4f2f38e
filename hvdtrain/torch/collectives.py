"""Horovod's PyTorch collectives behind :class:`hvdtrain.engine.Collectives`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import horovod.torch as hvd
import torch

from hvdtrain.engine import HorovodCollectives
from hvdtrain.shard import piece_bounds, pieces, round_ranges, shard_sizes


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


class Pieces:
    """A collective started with Horovod and waited for with :meth:`wait`: one of Horovod's
    asynchronous collectives, or several smaller ones (pieces) run one after another, each
    started when the one before has arrived, so that one is in flight at a time (pieces started
    together would be fused by Horovod into one again). Pieces after the first are driven by a
    thread of their own, so that they keep going while the caller computes (the backward pass
    of the next unit); left to :meth:`wait`, a unit's rounds would all run after its successor's
    backward pass, none of them beside it."""

    def __init__(self, count: int, start: Callable[[int], Any],
                 take: Callable[[int, torch.Tensor], None],
                 result: Callable[[], torch.Tensor]) -> None:
        self._count, self._start, self._take, self._result = count, start, take, result
        self._error: Exception | None = None
        self._handle = start(0)
        self._thread: threading.Thread | None = None
        if count > 1:
            self._thread = threading.Thread(target=self._drive, daemon=True,
                                            name="hvdtrain-pieces")
            self._thread.start()

    def _drive(self) -> None:
        try:
            for k in range(self._count):
                # hvd.poll and a short sleep, not hvd.synchronize: Horovod's wait keeps the
                # GIL while it sleeps, which would stall the caller's thread.
                while not hvd.poll(self._handle):
                    time.sleep(_POLL_S)
                self._take(k, hvd.synchronize(self._handle))
                self._handle = self._start(k + 1) if k + 1 < self._count else None
        except Exception as error:  # noqa: BLE001 -- re-raised in the caller's thread by wait()
            self._error = error

    def wait(self) -> torch.Tensor:
        """The collective's result, once every piece has arrived."""
        if self._thread is not None:
            self._thread.join()
            if self._error is not None:
                raise self._error
        elif self._handle is not None:
            self._take(0, hvd.synchronize(self._handle))
            self._handle = None
        return self._result()


_POLL_S = 0.0005
"""How long the pieces' thread sleeps between polls of the piece in flight."""


def _whole(handle: Any) -> Pieces:
    got: list[torch.Tensor] = []
    return Pieces(1, lambda _: handle, lambda _, part: got.append(part), lambda: got[0])


def piece_elements(piece_kib: int, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in ``piece_kib`` KiB (0: no pieces)."""
    return piece_kib * 1024 // torch.empty((), dtype=dtype).element_size()


def start_allgather(shard: torch.Tensor, name: str, process_set: Any, total: int, size: int,
                    piece_kib: int = 0) -> Pieces:
    """The all-gather of every rank's flat ``shard`` of a vector of ``total`` elements split
    over ``size`` ranks as :func:`~hvdtrain.shard.shard_bounds` splits it; with ``piece_kib``,
    in rounds of at most that many KiB per rank (``shard.piece_kib``: on a link where one large
    Gloo all-gather runs at half the rate, docs/sharding.md)."""
    piece = piece_elements(piece_kib, shard.dtype)
    count = pieces(total, size, piece) if piece else 1
    if count == 1:
        return _whole(hvd.allgather_async(shard, name=name, process_set=process_set))
    out = torch.empty(total, dtype=shard.dtype, device=shard.device)

    def start(k: int) -> Any:
        a, b = piece_bounds(shard.numel(), piece, k)
        return hvd.allgather_async(shard[a:b], name=f"{name}.{k}", process_set=process_set)

    def take(k: int, part: torch.Tensor) -> None:
        at = 0
        for lo, hi in round_ranges(total, size, piece, k):
            out[lo:hi] = part[at:at + hi - lo]
            at += hi - lo

    return Pieces(count, start, take, lambda: out)


def start_reducescatter(flat: torch.Tensor, name: str, process_set: Any, size: int, rank: int,
                        op: Any, piece_kib: int = 0) -> Pieces:
    """Horovod's reduce-scatter of ``flat`` (``rank``'s share of ``size``: its
    :func:`~hvdtrain.shard.shard_bounds`), with ``piece_kib`` in rounds of at most that many
    KiB per rank, as :func:`start_allgather`."""
    total = flat.numel()
    piece = piece_elements(piece_kib, flat.dtype)
    count = pieces(total, size, piece) if piece else 1
    if count == 1:
        return _whole(hvd.reducescatter_async(flat, name=name, op=op, process_set=process_set))
    own = shard_sizes(total, size)[rank]
    mine = torch.empty(own, dtype=flat.dtype, device=flat.device)

    def start(k: int) -> Any:
        send = torch.cat([flat[lo:hi] for lo, hi in round_ranges(total, size, piece, k)])
        return hvd.reducescatter_async(send, name=f"{name}.{k}", op=op, process_set=process_set)

    def take(k: int, part: torch.Tensor) -> None:
        a, b = piece_bounds(own, piece, k)
        mine[a:b] = part

    return Pieces(count, start, take, lambda: mine)
