"""Which rank owns which slice of the flat parameters (``shard.stage=1``): framework-free.

Sharded data parallel at stage 1 (docs/sharding.md) shards over a stage's data-parallel copies
(:meth:`hvdtrain.layout.Layout.stage_ranks`); its kernels are :mod:`hvdtrain.torch.shard`.

The trainable parameters, flattened and concatenated in model order, form one vector of
``total`` elements. Horovod's ``reducescatter`` cuts a tensor's first dimension among ``size``
ranks so that the first ``total % size`` ranks get one element more; every place that needs a
shard's bounds (the update, the allgather back, checkpoints) uses :func:`shard_bounds`, so they
agree with Horovod's split. A shard then maps back onto the parameters it overlaps
(:func:`segments`). Both collectives run in rounds (:func:`pieces`): in round ``k`` every rank's
``k``-th piece of at most ``chunk`` elements of its shard (:func:`round_ranges`), so that no
reduce-scatter or allgather holds more than ``size x chunk`` elements at once. The pieces of a
round are again split as Horovod splits their sum (shards differ by one element at most), so a
round's reduce-scatter hands each rank its own piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hvdtrain.errors import HvdtrainError


def shard_sizes(total: int, size: int) -> list[int]:
    """Elements per rank, as Horovod's ``reducescatter`` splits ``total``: the first ``total %
    size`` ranks get one more."""
    base, extra = divmod(total, size)
    return [base + (r < extra) for r in range(size)]


def shard_bounds(total: int, size: int, rank: int) -> tuple[int, int]:
    """The [start, stop) elements of the flat vector that ``rank`` of ``size`` owns."""
    sizes = shard_sizes(total, size)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


@dataclass(frozen=True)
class Segment:
    """Where a run of consecutive flat elements lies in one parameter."""

    param: int
    """The parameter's index, in the order of the sizes given."""
    offset: int
    """The first element within the (flattened) parameter."""
    flat: int
    """The first element within the flat vector."""
    length: int
    """How many elements."""


def segments(sizes: Sequence[int], start: int, stop: int) -> list[Segment]:
    """The pieces of the flat range [start, stop) in the parameters of these element counts, in
    order (parameters without elements in the range are left out)."""
    out, begin = [], 0
    for index, n in enumerate(sizes):
        lo, hi = max(start, begin), min(stop, begin + n)
        if lo < hi:
            out.append(Segment(param=index, offset=lo - begin, flat=lo, length=hi - lo))
        begin += n
    return out


def pieces(total: int, size: int, chunk: int) -> int:
    """Allgather rounds that bring every shard back in pieces of at most ``chunk`` elements: the
    same on every rank (set by the largest shard; at least one)."""
    largest = shard_sizes(total, size)[0]
    return max(1, -(-largest // chunk))


def piece_bounds(shard: int, chunk: int, index: int) -> tuple[int, int]:
    """The [start, stop) of piece ``index`` within a shard of ``shard`` elements (empty past its
    end: a shorter shard's last round sends nothing)."""
    start = min(index * chunk, shard)
    return start, min(start + chunk, shard)


def round_ranges(total: int, size: int, chunk: int, index: int) -> list[tuple[int, int]]:
    """The [start, stop) of the flat vector that each rank's piece of round ``index`` covers,
    in rank order: concatenated, what that round's collective carries."""
    sizes = shard_sizes(total, size)
    out, start = [], 0
    for n in sizes:
        a, b = piece_bounds(n, chunk, index)
        out.append((start + a, start + b))
        start += n
    return out


def step_bytes(total: int, own: int, compression: str) -> tuple[float, float]:
    """``(wire_bytes, dense_bytes)`` a rank hands Horovod per step: the whole gradient of
    ``total`` elements to reduce-scatter (float16 under ``fp16``) and its float32 shard of ``own``
    elements to all-gather; the dense count is the same in float32."""
    item = 2 if compression == "fp16" else 4
    return float(item * total + 4 * own), float(4 * total + 4 * own)


def check_resize(rank: int, size: int, new_rank: int, new_size: int) -> None:
    """Raises where elastic mode would move a rank or change their number: each rank's optimizer
    state is its shard's, which is not re-sharded."""
    if (new_rank, new_size) != (rank, size):
        raise HvdtrainError("shard.stage=1 cannot change its number of ranks")
