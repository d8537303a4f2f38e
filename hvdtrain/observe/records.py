"""Records and how they reach the sinks: the :class:`Sink` contract, the throttle, the logger.

Every rank calls :class:`MetricsLogger`'s methods; only rank 0 has sinks, so only it writes.
Records are flat dicts of numbers (plus an ``events`` list when something happened, such as a
straggler). :func:`make_logger` picks the sinks that ``cfg.log`` turns on from
:data:`hvdtrain.registry.SINKS` by name, so importing this module loads no sink's package (nor any
framework), and the dashboards (TensorBoard, W&B) are built only in the writer process
(:mod:`hvdtrain.observe.writer`).
"""

from __future__ import annotations

import abc
import math
import sys
from typing import Any

from hvdtrain.config import Config
from hvdtrain.observe.writer import SinkProcess, Spec
from hvdtrain.registry import SINKS
from hvdtrain.rundir import RunDir


class Sink(abc.ABC):
    """One destination for metric records."""

    @abc.abstractmethod
    def log(self, record: dict[str, Any]) -> None:
        """Writes one record."""

    def summary(self, summary: dict[str, Any]) -> None:
        """Records the run's final summary; most sinks have no place for it."""

    def flush(self) -> None:
        """Writes out what the sink holds back (most sinks hold nothing)."""

    def restart(self, step: int, total_steps: int) -> None:
        """The run goes on from ``step`` towards ``total_steps`` (an elastic reset to its last
        commit, at a new world size): records held back of later steps are forgotten, since they
        are trained again, and progress counts to the new total. Most sinks hold neither."""

    def close(self) -> None:
        """Flushes and releases what the sink holds."""

    def before_warning(self) -> None:
        """Called before a warning goes to stderr (the console ends its progress bar's line)."""


def has_eval(record: dict[str, Any]) -> bool:
    """Whether ``record`` holds an evaluation (the last record of an epoch)."""
    return "eval_accuracy" in record or "eval_loss" in record


class ThrottledSink(Sink):
    """Hands ``sink`` at most one record every ``every_s`` seconds of run time (``time_s``).

    The first record always goes, and so does every record that a reader must not miss: one with
    an evaluation, one with events (a straggler), and the last step's (``step >= total_steps``).
    The console and the dashboards (TensorBoard, W&B) sit behind one each (``log.console_every_s``,
    ``log.dashboard_every_s``); ``metrics.jsonl`` gets every record.
    """

    def __init__(self, sink: Sink | SinkProcess, every_s: float, total_steps: int) -> None:
        self._sink, self._every_s, self._total = sink, every_s, total_steps
        self._passed_at = -math.inf  # the run time (record's time_s) of the last record passed

    def due(self, record: dict[str, Any]) -> bool:
        """Whether ``record`` goes to the sink (it does not note that it went)."""
        kept = has_eval(record) or bool(record.get("events")) or record["step"] >= self._total
        return kept or record.get("time_s", 0.0) - self._passed_at >= self._every_s

    def log(self, record: dict[str, Any]) -> None:
        if self.due(record):
            self._passed_at = record.get("time_s", 0.0)
            self._sink.log(record)

    def summary(self, summary: dict[str, Any]) -> None:
        self._sink.summary(summary)

    def flush(self) -> None:
        self._sink.flush()

    def restart(self, step: int, total_steps: int) -> None:
        self._total = total_steps
        self._sink.restart(step, total_steps)

    def before_warning(self) -> None:
        self._sink.before_warning()

    def close(self) -> None:
        self._sink.close()


def throttled(sink: Sink | SinkProcess, every_s: float, total_steps: int) -> Sink | SinkProcess:
    """``sink`` behind a :class:`ThrottledSink`, or ``sink`` itself when ``every_s`` is 0."""
    return ThrottledSink(sink, every_s, total_steps) if every_s > 0 else sink


class MetricsLogger:
    """Fans records out to the sinks; on ranks other than 0 it holds none and does nothing.

    ``writer`` says whether this is the rank that writes (default: whether it has sinks); only the
    writer prints warnings, so that a warning that every rank reaches appears once.
    """

    def __init__(self, sinks: list[Sink | SinkProcess], writer: bool | None = None) -> None:
        self._sinks = sinks
        self.writer = bool(sinks) if writer is None else writer

    def warn(self, message: str) -> None:
        """Prints ``hvdtrain: warning: <message>`` to stderr on the writing rank."""
        if not self.writer:
            return
        for sink in self._sinks:
            sink.before_warning()
        print(f"hvdtrain: warning: {message}", file=sys.stderr, flush=True)

    def log(self, record: dict[str, Any]) -> None:
        """Writes ``record`` to every sink; non-finite numbers become null in JSON."""
        if not self._sinks:  # every rank but 0, and rank 0 with every sink off
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        for sink in self._sinks:
            sink.log(clean)

    def summary(self, summary: dict[str, Any]) -> None:
        """Hands the run's final summary to every sink (W&B keeps it as the run summary)."""
        for sink in self._sinks:
            sink.summary(summary)

    def flush(self) -> None:
        """Writes out what any sink holds back (``metrics.jsonl``'s held records): called before a
        checkpoint or commit, and at a stall; safe from another thread."""
        for sink in self._sinks:
            sink.flush()

    def restart(self, step: int, total_steps: int) -> None:
        """See :meth:`Sink.restart`: every sink continues from ``step`` towards ``total_steps``."""
        for sink in self._sinks:
            sink.restart(step, total_steps)

    def close(self) -> None:
        """Closes every sink."""
        for sink in self._sinks:
            sink.close()


def make_logger(cfg: Config, run_dir: RunDir, writer: bool, total_steps: int, *,
                start_step: int = 0, resumed: bool = False) -> MetricsLogger:
    """Rank 0 logs to each sink that ``cfg.log`` turns on (a resumed run continues its event files
    and its W&B run); the other ranks get no sinks."""
    if not writer:
        return MetricsLogger([], writer=False)
    log, sinks = cfg.log, []
    if log.jsonl:
        sinks.append(SINKS.get("jsonl")(run_dir.metrics, log.jsonl_every_s))
    if log.console:
        bar = log.progress == "bar" or (log.progress == "auto" and sys.stdout.isatty())
        console = SINKS.get("console")(total_steps, epochs=cfg.train.epochs, bar=bar,
                                       start_step=start_step)
        sinks.append(throttled(console, log.console_every_s, total_steps))
    remote = dashboards(cfg, run_dir, resumed)
    if remote:
        sinks.append(throttled(SinkProcess(remote), log.dashboard_every_s, total_steps))
    return MetricsLogger(sinks, writer=True)


def dashboards(cfg: Config, run_dir: RunDir, resumed: bool) -> list[Spec]:
    """The sinks that ``cfg.log`` turns on for the writer process: TensorBoard and W&B.

    They cost milliseconds of Python per record, holding the GIL that rank 0's training thread
    needs while every other rank waits for rank 0 at the next allreduce; in a process of their own
    they take that work off training. Where every core trains, their CPU time still comes out of
    training, hence the throttle, at W&B's advice of under one log call a second by default.
    """
    log, remote = cfg.log, []
    if log.tensorboard:
        remote.append(("tensorboard", {"logdir": str(run_dir.tensorboard), "fresh": not resumed}))
    if log.wandb != "disabled":
        remote.append(("wandb", {"run_dir": str(run_dir.root), "mode": log.wandb,
                                 "project": log.wandb_project, "name": cfg.name,
                                 "config": cfg.to_dict(), "resumed": resumed}))
    return remote
