"""One rank's run as the driver and elastic mode share it: where it starts, and a session that
runs the loop from a position with the collaborators that outlive an elastic reset."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hvdtrain.checkpoint import CheckpointManager
from hvdtrain.config import Config
from hvdtrain.data.contracts import Dataset
from hvdtrain.engine import Engine
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import GradientExchange
from hvdtrain.loop import Callback, Loop, Position, make_sampler, total_steps
from hvdtrain.observe.records import MetricsLogger, make_logger
from hvdtrain.rundir import RunDir
from hvdtrain.world import World


@dataclass
class Start:
    """Where a run starts, as rank 0 found it; shared with every rank."""

    position: Position = field(default_factory=Position)
    resumed: bool = False
    error: HvdtrainError | None = None
    """A problem rank 0 found before training; every rank raises it (its type picks the exit
    code), so all stop together."""


def tell_run_length(engine: Engine, total: int) -> None:
    """Tells the engine's gradient exchange that the run ends at step ``total`` (the compressing
    exchange's dense start is a fraction of it, ``comm.dense_fraction``); an engine without an
    exchange (a test's) has nothing to tell."""
    exchange = getattr(engine, "exchange", None)
    if isinstance(exchange, GradientExchange):
        exchange.run_length(total)


class Session:
    """One rank's run: the collaborators that outlive an elastic reset, and the loop of each entry."""

    def __init__(self, cfg: Config, run_dir: RunDir, engine: Engine, dataset: Dataset,
                 callbacks: Sequence[Callback], resumed: bool) -> None:
        self.cfg, self.run_dir, self.engine, self.dataset = cfg, run_dir, engine, dataset
        self.callbacks, self.resumed = list(callbacks), resumed
        # One for the whole run: a checkpoint still being written survives a reset.
        self.checkpoints = CheckpointManager(cfg.checkpoint, run_dir.checkpoints)
        self.logger: MetricsLogger | None = None
        self.loop: Loop | None = None
        self.startup_s: float | None = None  # the first loop's: an elastic reset does not restart it

    def run(self, world: World, position: Position, stop: Callable[[], bool],
            heartbeat: Callable[[], None], extra: Sequence[Callback] = ()) -> dict[str, Any]:
        """Trains in ``world`` (the run's, or elastic mode's at this world size) from
        ``position`` to the end of the run; returns the summary."""
        sampler = make_sampler(self.cfg, len(self.dataset.train()), world.accumulation)
        total = total_steps(self.cfg.train, sampler, world.size, position)
        tell_run_length(self.engine, total)
        logger = self._logger(total, position.step)
        logger.restart(position.step, total)  # a logger kept over an elastic reset: new total
        self.loop = Loop(self.cfg, world, self.engine, self.dataset, self.checkpoints, logger,
                         start=dataclasses.replace(position), total=total, stop_requested=stop,
                         heartbeat=heartbeat, callbacks=[*extra, *self.callbacks])
        try:
            return self.loop.run()
        finally:
            if self.startup_s is None:
                self.startup_s = self.loop.startup_s

    def write_metrics(self) -> None:
        """Logs the pending record and writes out what the logger holds (before an elastic commit)."""
        if self.loop is not None:
            self.loop.write_metrics()

    def flush_metrics(self) -> None:
        """Writes out the records this rank's logger holds (the stall watchdog, before it exits)."""
        if self.logger is not None:
            self.logger.flush()

    def close(self, summary: dict[str, Any] | None) -> None:
        """Hands the summary to the sinks, closes them and waits for the last checkpoint."""
        try:
            if self.logger is not None:
                if summary is not None:
                    self.logger.summary(summary)
                self.logger.close()
        finally:
            self.checkpoints.wait()  # the last checkpoint is on disk before the run ends or stops

    def _logger(self, total: int, start_step: int) -> MetricsLogger:
        """This rank's logger; a rank that becomes rank 0 after an elastic reset starts writing."""
        writer = self.engine.rank == 0
        if self.logger is None or self.logger.writer != writer:
            resumed = self.resumed or self.logger is not None
            if self.logger is not None:
                self.logger.close()
            self.logger = make_logger(self.cfg, self.run_dir, writer, total,
                                      start_step=start_step, resumed=resumed)
        return self.logger
