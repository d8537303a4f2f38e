"""``hvdtrain plan calibrate``: a cluster file from measurement, framework-free part.

Under ``horovodrun -np N`` (one rank per host to measure the link between hosts, or all on one
host for the link within it; N >= 2, best the job's own size under its own controller) the
framework side (:mod:`hvdtrain.torch.plan_calibrate`) times Horovod's broadcast and allreduce of
float32 buffers of several sizes. Over n ranks a ring allreduce costs
``o + 2(n-1)a + 2(n-1)/n m/B`` (docs/planner.md) and a small broadcast one message ``a``: a
straight line fitted to the allreduce's larger sizes gives the bandwidth ``B`` the ring reaches
(its slope is ``2(n-1)/(n B)``), the smallest sizes the latency ``a`` (a Horovod message, its
cycle and negotiation included) and the overhead of an allreduce call beyond its latencies ``o``.
A controller's ring that reaches less of the link as it grows (Open MPI's, against Gloo's) shows
as a lower ``B`` at that size: the plan then prices the ring as that job runs it.

What a ring step took beyond ``a + c/B`` at each swept size (:func:`step_excess`) is what a
straight line leaves out: over shaped TCP links a larger message's steps run slower than the
smallest's, so that the larger sizes' line meets the axis above the overhead. The plan adds it to
each ring step of the link measured (:meth:`hvdtrain.plan.cluster.Link.step_s`).
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
    """Median seconds per size of one collective among ``ranks`` ranks."""

    sizes: tuple[int, ...]
    broadcast_s: tuple[float, ...]
    allreduce_s: tuple[float, ...]
    ranks: int = 2


def link_of(sweep: Sweep) -> tuple[float, float, float]:
    """``(bandwidth Gbit/s, latency us, overhead us)`` from a sweep (module docstring).

    The bandwidth comes from the slope of the allreduce's larger half of sizes (where bytes
    dominate); the latency and the overhead from the smallest size, less its bytes' time: an
    intercept fitted over sizes a thousand times apart would carry the large sizes' noise. The
    latency is the smallest broadcast's, but no more than the ring's ``2(n-1)`` latencies leave
    room for in the smallest allreduce (a broadcast's tree does not cost what a ring's steps do),
    so that the formula gives back the smallest allreduce measured."""
    n = sweep.ranks
    if n < 2:
        raise ValueError("a sweep needs at least two ranks")
    half = len(sweep.sizes) // 2
    _, slope = fit_line(sweep.sizes[half:], sweep.allreduce_s[half:])
    if slope <= 0:
        raise ValueError("the allreduce's time does not grow with its size: no bandwidth to fit")
    per_byte = slope * n / (2 * (n - 1))  # 1/B
    ring_bytes = 2 * (n - 1) / n * sweep.sizes[0] * per_byte
    left = max(0.0, sweep.allreduce_s[0] - ring_bytes)
    latency = min(max(0.0, sweep.broadcast_s[0] - sweep.sizes[0] * per_byte),
                  left / (2 * (n - 1)))
    overhead = left - 2 * (n - 1) * latency
    return 8 / per_byte / 1e9, 1e6 * latency, 1e6 * overhead


def step_excess(sweep: Sweep) -> tuple[tuple[float, float], ...]:
    """Per swept size, ``(c, e)``: a ring step's chunk ``c = m/n`` and what each of the ring's
    ``2(n-1)`` steps took beyond ``a + c/B`` (the allreduce less ``o``, over ``2(n-1)``), at least
    0; ``a``, ``B`` and ``o`` the sweep's own (:func:`link_of`, by whose construction the
    smallest size's is 0), so that a cluster file's link edited for another rate keeps it."""
    n = sweep.ranks
    gbit, latency_us, overhead_us = link_of(sweep)
    per_byte, latency, overhead = 8 / (gbit * 1e9), latency_us * 1e-6, overhead_us * 1e-6
    return tuple((m / n, max(0.0, (t - overhead) / (2 * (n - 1)) - latency - m / n * per_byte))
                 for m, t in zip(sweep.sizes, sweep.allreduce_s, strict=True))


def cluster_tree(sweep: Sweep, hosts: Sequence[str], ranks_per_node: int,
                 controller: str = "") -> dict[str, Any]:
    """The cluster file's keys from a sweep among the ranks on ``hosts`` (rank order), run under
    ``controller`` (``mpi`` or ``gloo``, kept for the record)."""
    gbit, latency_us, overhead_us = link_of(sweep)
    link = {"bandwidth_gbit_s": round(gbit, 4), "latency_us": round(latency_us, 2)}
    nodes = len(set(hosts))
    return {"name": "calibrated", "nodes": nodes, "ranks_per_node": ranks_per_node,
            "compute_speed": 1.0, "intra": dict(link), "inter": dict(link),
            "message_overhead_us": round(overhead_us, 2),
            "calibration": {"hosts": list(hosts), "ranks": sweep.ranks,
                            "controller": controller,
                            "measured": "inter" if nodes > 1 else "intra",
                            "sizes": list(sweep.sizes), "broadcast_s": list(sweep.broadcast_s),
                            "allreduce_s": list(sweep.allreduce_s)}}
