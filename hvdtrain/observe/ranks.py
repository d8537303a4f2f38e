"""Per-rank costs per log interval: where step time goes, bytes on the wire, stragglers.

Everything rides on the loop's one metrics allreduce per log interval, so monitoring adds no
collective. Each rank puts its own numbers under rank-indexed keys (``mon.cpu.3`` holds rank 3's
CPU and 0 on every other rank); the sum over ranks then gives every rank every rank's value, the same
trick as the loop's ``nonfinite.<r>`` control. Per-step work is one ``perf_counter`` pair and the
engine's ``step_stats()``; the system (:mod:`hvdtrain.observe.system`) is sampled once per interval.
Framework-free.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hvdtrain.observe.system import SystemSampler

STAT_KEYS = ("data_s", "compute_s", "comm_s", "compress_s", "wire_bytes", "dense_bytes",
             "push_bytes", "pull_bytes", "cross_node_bytes", "pushes", "staleness_sum")
"""What :meth:`hvdtrain.engine.Engine.step_stats` reports about the last step (all optional;
``push_bytes`` and ``pull_bytes``: to and from parameter servers, the two parts of
``wire_bytes``; ``cross_node_bytes``: the part of ``wire_bytes`` in collectives that span
nodes, under ``shard.group=node``). A pipeline stage also reports ``pipe_wait_s``, its wait for
its neighbours, apart from its ``compute_s``: :meth:`Monitor.outgoing` sends both per rank, for
the per-stage figures."""
DIRECTIONS = ("push_bytes", "pull_bytes", "cross_node_bytes")
"""Parts of ``wire_bytes``: in a record only where an exchange reported them (parameter
servers' directions, sharding within a node's bytes across nodes)."""

STALENESS_MAX = "staleness_max"
"""Under ``ps.consistency=ssp``/``asp`` an exchange also reports ``pushes`` (1 a step), the
``staleness_sum`` of what they saw and their ``staleness_max``: a window keeps the largest, and
each rank sends its own (:func:`rank_keys`), so a record has the mean over every push and the
maximum over all of them."""

TIME_NAMES = {"data_s": "data_wait_time_s", "compute_s": "compute_time_s", "comm_s": "comm_time_s",
              "compress_s": "compress_time_s"}
"""Record key of each per-step time: its mean over the window's steps and the ranks
(``compress_time_s`` is the part of ``compute_time_s`` spent in compression kernels)."""

PER_RANK = {"cpu": "cpu_percent", "rss": "rss_mb", "gpu": "gpu_util_percent", "gpu_mem": "gpu_mem_mb"}
"""System samples sent per rank (:meth:`SystemSampler.sample`'s names), and the record key prefix
of each (``cpu_percent_rank0``)."""

STAGE_KEYS = ("compute_s", "pipe_wait_s", "activation_mb")
"""The step stats a pipeline stage sends per rank: its compute, its wait for the neighbouring
stages and, where the engine counts them (PyTorch), the peak MiB of activations its forward passes
saved for the backward passes (largest copy per stage: ``stage_activation_mb_stage<k>``)."""

STAGE_MEMORY = ("rss", "gpu_mem")
"""The system samples that pipeline runs also report per stage (``stage_rss_mb_stage<k>``)."""

PREFIX = "mon."


def rank_keys(name: str, rank: int, size: int, value: float) -> dict[str, float]:
    """``{name.r: value}`` for this rank and 0 for the others: summed over ranks, every rank learns
    every rank's value."""
    return {f"{name}.{r}": (value if r == rank else 0.0) for r in range(size)}


def pop_ranks(sums: dict[str, float], name: str, size: int) -> list[float]:
    """Removes the rank-indexed keys of ``name`` from the summed dict; returns them by rank."""
    return [sums.pop(f"{name}.{r}") for r in range(size)]


@dataclass
class StepCosts:
    """One rank's sums over a log window: time inside ``train_step`` and the engine's step stats."""

    wall_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)
    reported: bool = False
    """Whether the engine reported any step stats (an engine without them leaves the keys out)."""

    def add(self, wall_s: float, stats: dict[str, float]) -> None:
        """Adds one step: its wall time in ``train_step`` and the engine's stats for it."""
        self.wall_s += wall_s
        for key, value in stats.items():
            if key == STALENESS_MAX:  # a maximum, not a sum
                self.stats[key] = max(self.stats.get(key, 0.0), float(value))
            else:
                self.stats[key] = self.stats.get(key, 0.0) + float(value)
        self.reported = self.reported or bool(stats)

    def own_time(self) -> float:
        """Time in ``train_step`` less the wait for other ranks (the exchange, a pipeline's
        neighbours): what makes a rank slow."""
        waited = self.stats.get("comm_s", 0.0) + self.stats.get("pipe_wait_s", 0.0)
        return max(self.wall_s - waited, 0.0)

    def wait_fraction(self) -> float:
        """The share of time in ``train_step`` a pipeline stage waited for its neighbours."""
        return min(self.stats.get("pipe_wait_s", 0.0) / self.wall_s, 1.0) if self.wall_s > 0 else 0.0


def stage_means(values: Sequence[float], stages: Sequence[int], name: str,
                reduce: Callable[[list[float]], float] = statistics.fmean) -> dict[str, float]:
    """``{name_stage<k>: reduce(values of stage k's ranks)}`` (``stages``: each rank's stage; the
    mean by default)."""
    out = {}
    for stage in sorted(set(stages)):
        mine = [v for v, s in zip(values, stages, strict=True) if s == stage]
        out[f"{name}_stage{stage}"] = reduce(mine)
    return out


@dataclass(frozen=True)
class Straggler:
    """A rank slower than the others for ``logs`` consecutive log intervals."""

    rank: int
    factor: float
    """Its own step time divided by the median of the other ranks' (last interval)."""
    logs: int

    def message(self, step: int) -> str:
        """The warning that names it."""
        return (f"rank {self.rank} is a straggler: its step time was {self.factor:.2f}x the median "
                f"of the other ranks for {self.logs} consecutive logs (up to step {step})")


class StragglerDetector:
    """Counts, per rank, consecutive intervals whose own step time exceeds ``factor`` times the
    median of the other ranks; reports a rank once per streak, when the streak reaches ``logs``.

    The median of the *other* ranks, not of all: with two ranks the median of all is their mean,
    which a slow rank drags up with it. With pipeline stages (``groups``: each rank's stage) only
    the other ranks of the same stage count, since stages do different work; a stage of one copy
    has no one to compare with.
    """

    def __init__(self, factor: float, logs: int, groups: Sequence[int] | None = None) -> None:
        self.factor, self.logs = factor, logs
        self.groups = groups
        self._streak: dict[int, int] = {}

    def update(self, times: Sequence[float]) -> list[Straggler]:
        """Takes one interval's step time of every rank; returns the ranks that just qualified."""
        groups = self.groups or [0] * len(times)
        found = []
        for rank, own in enumerate(times):
            others = [t for r, t in enumerate(times) if r != rank and groups[r] == groups[rank]]
            median = statistics.median(others) if others else 0.0
            slow = median > 0 and own > self.factor * median
            self._streak[rank] = self._streak.get(rank, 0) + 1 if slow else 0
            if self._streak[rank] == self.logs:
                found.append(Straggler(rank, own / median, self.logs))
        return found


class Monitor:
    """What monitoring adds to the loop's metrics allreduce, and what it makes of the sums."""

    def __init__(self, rank: int, size: int, local_rank: int, *, system: bool,
                 straggler_factor: float, straggler_logs: int,
                 warn: Callable[[str], None], stages: Sequence[int] | None = None) -> None:
        self.rank, self.size = rank, size
        self.stages = stages
        """Each rank's pipeline stage (:meth:`hvdtrain.engine.Engine.pipeline_stages`) or None."""
        self.sampler = SystemSampler(local_rank) if system else None
        self.stragglers = StragglerDetector(straggler_factor, straggler_logs, stages)
        self.warn = warn
        self.totals = {"wire_bytes": 0.0, "dense_bytes": 0.0, "compress_s": 0.0, "pushes": 0.0,
                       "staleness_sum": 0.0, STALENESS_MAX: 0.0}

    def outgoing(self, costs: StepCosts, steps: int) -> dict[str, float]:
        """This rank's contribution to the window's allreduce (all keys under ``mon.``)."""
        out = {f"{PREFIX}{key}": costs.stats.get(key, 0.0) for key in STAT_KEYS}
        out[f"{PREFIX}reported"] = float(costs.reported)
        out.update(rank_keys(f"{PREFIX}step", self.rank, self.size, costs.own_time() / max(steps, 1)))
        if "pushes" in costs.stats:  # every rank alike: the exchange's kind is the run's
            out.update(rank_keys(f"{PREFIX}{STALENESS_MAX}", self.rank, self.size,
                                 costs.stats.get(STALENESS_MAX, 0.0)))
        if self.stages is not None:
            # activation_mb only where the engine counts it (every rank of a run alike).
            for key in STAGE_KEYS if "activation_mb" in costs.stats else STAGE_KEYS[:2]:
                out.update(rank_keys(f"{PREFIX}stage.{key}", self.rank, self.size,
                                     costs.stats.get(key, 0.0) / max(steps, 1)))
            out[f"{PREFIX}bubble"] = costs.wait_fraction()
        if self.sampler is not None:
            sample = self.sampler.sample()
            out[f"{PREFIX}gpus"] = float("gpu" in sample)
            for name in PER_RANK:
                out.update(rank_keys(PREFIX + name, self.rank, self.size, sample.get(name, 0.0)))
        return out

    def incoming(self, sums: dict[str, float], steps: int, step: int) -> dict[str, Any]:
        """Pops the ``mon.`` keys from the summed dict; returns the record's monitoring fields."""
        record: dict[str, Any] = {}
        per_step = max(steps, 1) * self.size
        stats = {key: sums.pop(f"{PREFIX}{key}") for key in STAT_KEYS}
        if sums.pop(f"{PREFIX}reported") > 0:
            record.update({TIME_NAMES[k]: stats[k] / per_step for k in TIME_NAMES})
            record.update(wire_bytes=stats["wire_bytes"] / per_step,
                          dense_bytes=stats["dense_bytes"] / per_step)
            if stats["wire_bytes"] > 0:
                record["compression_ratio"] = stats["dense_bytes"] / stats["wire_bytes"]
            record.update({k: stats[k] / per_step for k in DIRECTIONS if stats[k] > 0})
            for key in ("wire_bytes", "dense_bytes", "compress_s", "pushes", "staleness_sum"):
                self.totals[key] += stats[key]
        if f"{PREFIX}{STALENESS_MAX}.0" in sums:
            record.update(self._staleness(stats, sums))
        record.update(self._step_times(pop_ranks(sums, f"{PREFIX}step", self.size), step))
        if self.stages is not None:
            record.update(self._stages(sums))
        if f"{PREFIX}gpus" in sums:
            record.update(self._system(sums))
        return record

    def _step_times(self, times: list[float], step: int) -> dict[str, Any]:
        slowest = max(range(self.size), key=times.__getitem__)
        out: dict[str, Any] = {"step_time_median_s": statistics.median(times),
                               "step_time_max_s": times[slowest], "slowest_rank": slowest}
        found = self.stragglers.update(times)
        if found:
            worst = max(found, key=lambda s: s.factor)
            out.update(straggler_rank=worst.rank, straggler_factor=worst.factor,
                       events=[{"event": "straggler", "rank": s.rank, "factor": s.factor,
                                "logs": s.logs} for s in found])
            for straggler in found:
                self.warn(straggler.message(step))
        return out

    def _staleness(self, stats: dict[str, float], sums: dict[str, float]) -> dict[str, float]:
        """The window's ``staleness_mean`` over every push and ``staleness_max`` over all."""
        largest = max(pop_ranks(sums, f"{PREFIX}{STALENESS_MAX}", self.size))
        self.totals[STALENESS_MAX] = max(self.totals[STALENESS_MAX], largest)
        pushes = stats["pushes"]
        return {"staleness_mean": stats["staleness_sum"] / pushes if pushes else 0.0,
                STALENESS_MAX: largest}

    def _stages(self, sums: dict[str, float]) -> dict[str, float]:
        """Per stage, the mean over its copies of a step's compute and wait; the bubble fraction:
        the mean over ranks of the share of the step spent waiting."""
        assert self.stages is not None
        out = {"bubble_fraction": sums.pop(f"{PREFIX}bubble") / self.size}
        for key, name in (("compute_s", "stage_compute_s"), ("pipe_wait_s", "stage_wait_s")):
            values = pop_ranks(sums, f"{PREFIX}stage.{key}", self.size)
            out.update(stage_means(values, self.stages, name))
        if f"{PREFIX}stage.activation_mb.0" in sums:
            values = pop_ranks(sums, f"{PREFIX}stage.activation_mb", self.size)
            out.update(stage_means(values, self.stages, "stage_activation_mb", max))
        return out

    def _system(self, sums: dict[str, float]) -> dict[str, float]:
        """Each rank's system figures; with pipeline stages also each stage's memory: the most any
        of its copies holds, since a per-rank memory limit is what a split must stay under."""
        gpus = sums.pop(f"{PREFIX}gpus") > 0
        out = {}
        for name, key in PER_RANK.items():
            values = pop_ranks(sums, PREFIX + name, self.size)
            if gpus or not name.startswith("gpu"):
                out.update({f"{key}_rank{r}": v for r, v in enumerate(values)})
                if self.stages is not None and name in STAGE_MEMORY:
                    out.update(stage_means(values, self.stages, f"stage_{key}", max))
        return out

    def summary(self) -> dict[str, float]:
        """``wire_bytes_total`` and ``dense_bytes_total`` over all logged steps and ranks, and their
        ratio; ``compress_time_s_total`` where compression kernels ran; empty when the engine
        reported no bytes."""
        wire, dense = self.totals["wire_bytes"], self.totals["dense_bytes"]
        if not wire and not dense:
            return {}
        out = {"wire_bytes_total": wire, "dense_bytes_total": dense}
        if wire > 0:
            out["compression_ratio"] = dense / wire
        if self.totals["compress_s"] > 0:
            out["compress_time_s_total"] = self.totals["compress_s"]
        if self.totals["pushes"] > 0:  # ssp/asp parameter servers
            out.update(pushes_total=self.totals["pushes"],
                       staleness_mean=self.totals["staleness_sum"] / self.totals["pushes"],
                       staleness_max=self.totals[STALENESS_MAX])
        return out
