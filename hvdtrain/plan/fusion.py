"""Tensor Fusion overlapped with the backward pass: which gradients travel together, and when.

Horovod's background thread wakes every cycle (``comm.cycle_time_ms``, 1 ms by default), takes the
gradients that became ready on every rank since, packs them in ready order into fusion buffers of
at most ``HOROVOD_FUSION_THRESHOLD`` bytes (64 MiB by default; a larger tensor goes alone) and
reduces the buffers one after another; a cycle whose collectives outlast it delays the next
(Sergeev & Del Balso 2018, section 4; Horovod's docs, "Tensor Fusion"). :func:`fuse` replays that
on the profile's gradient-ready times with the cost of one collective as a function of its bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hvdtrain.plan.profile import TensorProfile

FUSION_THRESHOLD = 64 * 1024 * 1024
"""Horovod's default ``HOROVOD_FUSION_THRESHOLD``: 64 MiB."""
DEFAULT_CYCLE_MS = 1.0
"""Horovod's own cycle time, what ``comm.cycle_time_ms: 0`` leaves in force."""


@dataclass(frozen=True)
class Bucket:
    """One fused collective: its tensors, bytes, and when it ran (seconds from the start of the
    backward pass)."""

    tensors: tuple[str, ...]
    bytes: int
    start_s: float
    end_s: float


def _pack(ready: Sequence[TensorProfile], threshold: int) -> list[list[TensorProfile]]:
    """Consecutive tensors into buffers of at most ``threshold`` bytes (one too large goes alone)."""
    groups: list[list[TensorProfile]] = []
    size = threshold + 1
    for t in ready:
        if not groups or size + t.bytes > threshold:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.bytes
    return groups


def _next_tick(tick: float, ready: float, cycle_s: float) -> float:
    """The first cycle at or after ``ready`` (cycles every ``cycle_s`` from ``tick``)."""
    if ready <= tick:
        return tick
    if cycle_s <= 0:
        return ready
    return tick + math.ceil((ready - tick) / cycle_s - 1e-12) * cycle_s


def fuse(tensors: Sequence[TensorProfile], cost: Callable[[float], float], cycle_s: float,
         threshold: int = FUSION_THRESHOLD, time_scale: float = 1.0) -> list[Bucket]:
    """The fused collectives of one step. ``cost(bytes)`` is one collective's time; ready times
    are multiplied by ``time_scale`` (a faster or slower rank, another batch size)."""
    pending = sorted(tensors, key=lambda t: t.ready_s)
    buckets: list[Bucket] = []
    tick = clock = 0.0
    i = 0
    while i < len(pending):
        tick = _next_tick(max(tick, clock), pending[i].ready_s * time_scale, cycle_s)
        j = i
        while j < len(pending) and pending[j].ready_s * time_scale <= tick + 1e-12:
            j += 1
        start = tick
        for group in _pack(pending[i:j], threshold):
            size = sum(t.bytes for t in group)
            end = start + cost(size)
            buckets.append(Bucket(tuple(t.name for t in group), size, start, end))
            start = end
        clock, i = start, j
        tick += cycle_s
    return buckets


def overlapped_end(buckets: Sequence[Bucket], backward_s: float) -> float:
    """When both the backward pass and the last collective have finished (from backward start)."""
    return max([backward_s, *(b.end_s for b in buckets)])
