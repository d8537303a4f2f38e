"""The control values that ride on the metrics allreduce, and what the ranks agree from them.

Every log interval the loop sums its metrics over the ranks in one collective. Beside them go a
stop request from any rank (a signal), which ranks saw a non-finite loss and from which step,
whether a write of rank 0 failed (a checkpoint, ``metrics.jsonl``), and the monitor's per-rank
step costs and system samples (:mod:`hvdtrain.observe.ranks`). Every rank reads them from the same
sum and so acts after the same step: no rank stops, or raises, alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hvdtrain.observe.ranks import Monitor, StepCosts, pop_ranks, rank_keys


@dataclass
class Agreed:
    """What every rank learnt from one sum: the metric sums alone, and the controls."""

    sums: dict[str, float]
    stop: bool
    write_failed: bool
    first_nonfinite: dict[int, int]
    """Per rank the first step with a non-finite loss (0: none)."""
    health: dict[str, Any] = field(default_factory=dict)
    """The monitor's figures for the record (per-rank step times, stragglers, system samples)."""


class Controls:
    """One rank's controls: what it adds to a metrics sum, and what it reads back from one."""

    def __init__(self, rank: int, size: int, monitor: Monitor, *,
                 stop_requested: Callable[[], bool], write_failed: Callable[[], bool]) -> None:
        self.rank, self.size, self.monitor = rank, size, monitor
        self.stop_requested, self.write_failed = stop_requested, write_failed
        self.first_nonfinite = 0
        """The first step with a NaN or Inf loss on this rank (0: none)."""
        self.stop_agreed = False
        """Whether any rank asked to stop, as learnt from a sum: sticky once true."""

    def note_loss(self, step: int, loss: float) -> None:
        """Notes the loss of step ``step``; a non-finite one is acted on at the next sum."""
        if not self.first_nonfinite and not math.isfinite(loss):
            self.first_nonfinite = step

    def outgoing(self, costs: StepCosts, steps: int) -> dict[str, float]:
        """The values this rank adds to the metric sums of a window of ``steps`` steps."""
        return {**rank_keys("nonfinite", self.rank, self.size, self.first_nonfinite),
                "stop": float(self.stop_requested()), "write_failed": float(self.write_failed()),
                **self.monitor.outgoing(costs, steps)}

    def incoming(self, sums: dict[str, float], steps: int, step: int) -> Agreed:
        """Takes the controls out of a finished sum over ``steps`` steps ending at ``step``."""
        sums = dict(sums)
        stop = sums.pop("stop") > 0
        self.stop_agreed = self.stop_agreed or stop
        write_failed = sums.pop("write_failed") > 0
        first_bad = dict(enumerate(map(int, pop_ranks(sums, "nonfinite", self.size))))
        health = self.monitor.incoming(sums, steps, step)  # takes its own keys out of sums
        return Agreed(sums, stop, write_failed, first_bad, health)
