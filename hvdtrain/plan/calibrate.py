"""``hvdtrain plan calibrate``: a cluster file from measurement, framework-free part.

Under ``horovodrun -np 2`` (one rank per host to measure the link between hosts, or both on one
host for the link within it) the framework side (:mod:`hvdtrain.torch.plan_calibrate`) times
Horovod's broadcast and allreduce of float32 buffers of several sizes. Between two ranks a
broadcast costs ``a + m/B`` and a ring allreduce ``o + 2a + m/B`` (docs/planner.md): a straight
line fitted to each sweep gives the latency ``a`` (the broadcast's intercept: a Horovod message,
its cycle and negotiation included), the bandwidth ``B`` (one over the allreduce's slope) and the
overhead of an allreduce call beyond its two latencies ``o``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SIZES = tuple(4 ** k * 1024 for k in range(1, 8))
"""The swept buffer sizes in bytes: 4 KiB to 16 MiB, by fours."""
REPEATS = 5
"""Timed repetitions per size (after one untimed); the median is kept."""


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = intercept + slope x``; returns ``(intercept, slope)``."""
    n = len(xs)
    if n < 2:
        raise ValueError("a line needs at least two points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


@dataclass(frozen=True)
class Sweep:
    """Median seconds per size of one collective between two ranks."""

    sizes: tuple[int, ...]
    broadcast_s: tuple[float, ...]
    allreduce_s: tuple[float, ...]


def link_of(sweep: Sweep) -> tuple[float, float, float]:
    """``(bandwidth Gbit/s, latency us, overhead us)`` from a sweep (module docstring).

    The bandwidth is the slope of the allreduce's larger half of sizes (where bytes dominate);
    the latency and the overhead come from the smallest size, less its bytes' time: an intercept
    fitted over sizes a thousand times apart would carry the large sizes' noise."""
    half = len(sweep.sizes) // 2
    _, slope = fit_line(sweep.sizes[half:], sweep.allreduce_s[half:])
    if slope <= 0:
        raise ValueError("the allreduce's time does not grow with its size: no bandwidth to fit")
    small = sweep.sizes[0] * slope
    latency = max(0.0, sweep.broadcast_s[0] - small)
    overhead = max(0.0, sweep.allreduce_s[0] - small - 2 * latency)
    return 8 / slope / 1e9, 1e6 * latency, 1e6 * overhead


def cluster_tree(sweep: Sweep, hosts: Sequence[str], ranks_per_node: int) -> dict[str, Any]:
    """The cluster file's keys from a sweep between two ranks on ``hosts`` (rank order)."""
    gbit, latency_us, overhead_us = link_of(sweep)
    link = {"bandwidth_gbit_s": round(gbit, 4), "latency_us": round(latency_us, 2)}
    nodes = len(set(hosts))
    return {"name": "calibrated", "nodes": nodes, "ranks_per_node": ranks_per_node,
            "compute_speed": 1.0, "intra": dict(link), "inter": dict(link),
            "message_overhead_us": round(overhead_us, 2),
            "calibration": {"hosts": list(hosts), "measured": "inter" if nodes > 1 else "intra",
                            "sizes": list(sweep.sizes), "broadcast_s": list(sweep.broadcast_s),
                            "allreduce_s": list(sweep.allreduce_s)}}
