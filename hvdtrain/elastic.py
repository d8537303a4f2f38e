"""Elastic training: the run continues when workers die or join (``elastic.enabled``).

Framework-free policy on Horovod's elastic ``State``, which takes its collectives as callables; the
framework modules (``hvdtrain.torch.elastic``, ``hvdtrain.tensorflow.elastic``) only supply them.

- The state is the engine's own checkpoint (model, optimizer, random-number states, compression
  state) written into memory, plus the run's :class:`~hvdtrain.loop.Position` and counters. It is
  committed every ``elastic.commit_every`` steps at a step boundary; a worker that dies costs the
  others at most that many steps, which they redo from the last commit.
- After a reset the loop is rebuilt at the new world size from the committed position: the samples
  of the epoch not yet trained on are re-sharded over the new ranks (:class:`ShardedSampler` with
  ``start``), so every sample is used exactly once per epoch. Horovod's own ``ElasticSampler`` is
  not used: it loses indices when workers leave (horovod issue 3143).
- The learning rate follows the new world size (``on_resize: scale_lr``), or accumulation keeps the
  starting global batch and learning rate (``keep_global_batch``).
- Nothing runs a collective before the function given to ``hvd.elastic.run``: a worker that joins
  would otherwise meet the others in the wrong collective.
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from hvdtrain.checkpoint import CheckpointManager
from hvdtrain.config import Config
from hvdtrain.data import Dataset, StepIndices
from hvdtrain.engine import Engine, make_engine
from hvdtrain.errors import HvdtrainError
from hvdtrain.loop import Loop, Position, StepHooks
from hvdtrain.observe.records import MetricsLogger, make_logger
from hvdtrain.observe.watchdog import StallWatchdog
from hvdtrain.resume import trim_metrics
from hvdtrain.signals import StopRequest

if TYPE_CHECKING:  # the state subclasses Horovod's, which only training needs to import
    from hvdtrain.elastic_state import TrainingState

EVENTS = "elastic.jsonl"
"""The run directory's log of elastic events (start, reset), one JSON object per line."""


@dataclass(frozen=True)
class ElasticBackend:
    """One framework's collectives and engine adjustments, as the elastic policy needs them."""

    run: Callable[[Callable[..., Any]], Callable[..., Any]]
    """Horovod's ``hvd.elastic.run`` of the framework."""
    broadcast_object: Callable[[Any], Any]
    allgather_object: Callable[[Any], list[Any]]
    rank: Callable[[], int]
    refresh: Callable[[Engine], None]
    """Updates the engine's rank and sizes after Horovod restarted at another world size."""
    set_accumulation: Callable[[Engine, int], None]
    """Sets the micro-batches the engine accumulates before each allreduce."""
    fork_rng: Callable[[int, int, int], None]
    """``fork_rng(seed, rank, step)``: a rank's own random stream after receiving rank 0's state."""


def loop_config(cfg: Config, reference_size: int, size: int) -> Config:
    """The config the loop runs with at world size ``size`` of a run that started at ``reference_size``.

    ``scale_lr`` changes nothing: the learning rate already follows the world size. With
    ``keep_global_batch`` the ranks accumulate ``reference_size x accumulation / size``
    micro-batches, and the one-rank rate is rescaled so that the scaled rate stays the starting one.
    """
    if cfg.elastic.on_resize != "keep_global_batch" or size == reference_size:
        return cfg
    micro = reference_size * cfg.train.backward_passes_per_step
    accumulation = max(1, round(micro / size))
    if accumulation * size != micro:
        warnings.warn(f"elastic.on_resize=keep_global_batch: {micro} micro-batches per step cannot be "
                      f"split evenly over {size} ranks; using {accumulation} per rank", stacklevel=2)
    lr = cfg.optim.lr * reference_size / size if cfg.optim.scale_lr else cfg.optim.lr
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, backward_passes_per_step=accumulation),
        optim=dataclasses.replace(cfg.optim, lr=lr))


class IndexRecord:
    """The sample indices trained on per epoch, counting committed steps only.

    Each rank keeps its own indices since the last commit; a commit gathers them into the record,
    which is part of the committed state, so steps that a reset rolls back drop out of it again.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.committed: dict[int, list[np.ndarray]] = {}
        self.pending: dict[int, list[np.ndarray]] = {}

    def add(self, epoch: int, indices: StepIndices) -> None:
        """Notes this rank's indices of one step."""
        if self.enabled:
            self.pending.setdefault(epoch, []).extend(m for m in indices.micro if len(m))

    def gather(self, allgather_object: Callable[[Any], list[Any]]) -> None:
        """Moves every rank's pending indices into the record (a collective when enabled)."""
        if not self.enabled:
            return
        for pending in allgather_object(self.pending):
            for epoch, arrays in pending.items():
                self.committed.setdefault(epoch, []).extend(arrays)
        self.pending = {}

    def snapshot(self) -> dict[int, list[np.ndarray]]:
        """A copy of the record to keep with a commit."""
        return {epoch: list(arrays) for epoch, arrays in self.committed.items()}

    def reset_to(self, committed: dict[int, list[np.ndarray]]) -> None:
        """Returns to a committed record, dropping what was trained since."""
        self.committed, self.pending = {e: list(a) for e, a in committed.items()}, {}

    def write(self, directory: Path) -> None:
        """Writes ``epoch-<e>.npy`` per epoch: its indices in the order they were gathered."""
        directory.mkdir(parents=True, exist_ok=True)
        for epoch, arrays in self.committed.items():
            np.save(directory / f"epoch-{epoch:04d}.npy",
                    np.concatenate(arrays) if arrays else np.zeros(0, np.int64))


def hooks(state: TrainingState, commit_every: int,
          before_commit: Callable[[], None] = lambda: None) -> StepHooks:
    """The loop's hooks: note each step's indices, commit every ``commit_every`` steps, each
    commit after ``before_commit`` (the loop writing out its metrics records, which a new rank 0
    keeps up to the commit)."""
    def boundary(position: Position) -> None:
        if position.step - state.position.step >= commit_every:
            before_commit()
            state.commit_at(position)
    return StepHooks(stepped=state.record.add, boundary=boundary)


def log_event(run_dir: Path, event: dict[str, Any]) -> None:
    """Appends one event to the run directory's ``elastic.jsonl`` (rank 0 calls it)."""
    with (run_dir / EVENTS).open("a") as fileobj:
        fileobj.write(json.dumps({"time": time.time(), **event}) + "\n")


def entry_event(state: TrainingState, loop: Loop) -> dict[str, Any]:
    """What happened before this entry into the training function: the start or a reset."""
    position, size = state.position, state.engine.size
    event: dict[str, Any] = {"event": "reset" if state.resets else "start", "world_size": size,
                             "step": position.step, "epoch": position.epoch,
                             "in_epoch": position.in_epoch,
                             "accumulation": loop.cfg.train.backward_passes_per_step}
    if state.failed_at is not None:
        event["lost_steps"] = state.failed_at - position.step
    return event


def backend_for(framework: str) -> ElasticBackend:
    """The framework's elastic backend, imported only now (the core stays framework-free)."""
    if framework == "torch":
        from hvdtrain.torch.elastic import backend
    else:
        from hvdtrain.tensorflow.elastic import backend
    return backend()


def _start_on_rank0(cfg: Config, engine: Engine, resume_from: Path | None) -> tuple[Position, str]:
    """Rank 0's start (no communication): checks and prepares the run directory and restores the
    checkpoint to resume from. A problem becomes a message that ``sync`` gives to every rank."""
    from hvdtrain.resume import read_position
    from hvdtrain.trainer import check_run_dir, prepare_run_dir

    try:
        if resume_from is None:
            check_run_dir(cfg)
        start = read_position(engine, resume_from, cfg) if resume_from else None
        prepare_run_dir(cfg, True, start)
    except HvdtrainError as exc:
        return Position(), str(exc)
    return start or Position(), ""


class ElasticDriver:
    """The function that ``hvd.elastic.run`` calls again after every reset, and what it keeps."""

    def __init__(self, cfg: Config, engine: Engine, dataset: Dataset, resumed: bool) -> None:
        self.cfg, self.engine, self.dataset, self.resumed = cfg, engine, dataset, resumed
        self.logger: MetricsLogger | None = None
        self.loop: Loop | None = None
        # One for the whole run: a checkpoint still being written survives a reset.
        self.checkpoints = CheckpointManager(cfg.checkpoint, cfg.run_dir / "checkpoints",
                                             writer=False)

    def __call__(self, state: TrainingState, stop: Callable[[], bool],
                 heartbeat: Callable[[], None]) -> dict[str, Any]:
        """Trains from the committed state at the current world size to the end of the run."""
        state.backend.refresh(self.engine)
        if state.error:
            raise HvdtrainError(state.error)
        cfg = loop_config(self.cfg, state.reference_size, self.engine.size)
        state.backend.set_accumulation(self.engine, cfg.train.backward_passes_per_step)
        writer = self.checkpoints.writer = self.engine.rank == 0
        loop = self.loop = Loop(cfg, self.engine, self.dataset, self.checkpoints,
                                dataclasses.replace(state.position), stop, heartbeat,
                                hooks(state, cfg.elastic.commit_every, self._write_metrics))
        if self.logger is not None:  # held records of steps after the commit: trained again
            self.logger.rewind(state.position.step)
        if writer:
            log_event(cfg.run_dir, entry_event(state, loop))
            # Steps after the commit are trained again: their records would appear twice.
            trim_metrics(cfg.run_dir / "metrics.jsonl", state.position.step)
        try:
            summary = loop.run(self._logger(writer, loop))
            state.record.gather(state.backend.allgather_object)
        except Exception:
            state.failed_at = loop.pos.step  # how far this rank got: the steps a reset loses
            raise
        return {**summary, "elastic": {"commits": state.commits, "resets": state.resets,
                                       "start_world_size": state.reference_size}}

    def flush_metrics(self) -> None:
        """Writes out the metrics records this rank's logger holds (at a stall)."""
        if self.logger is not None:
            self.logger.flush()

    def _write_metrics(self) -> None:
        """Before each commit: every record up to it on disk (a new rank 0 keeps those)."""
        if self.loop is not None:
            self.loop.write_metrics()

    def _logger(self, writer: bool, loop: Loop) -> MetricsLogger:
        """This rank's logger; a rank that becomes rank 0 after a reset starts writing."""
        if self.logger is None or self.logger.writer != writer:
            if self.logger is not None:
                self.logger.close()
            resumed = self.resumed or self.logger is not None
            self.logger = make_logger(self.cfg, self.cfg.run_dir, writer, loop.total_steps,
                                      start_step=loop.pos.step, resumed=resumed)
        return self.logger


def train_elastic(cfg: Config, resume_from: Path | None) -> Any:
    """``train(cfg)`` in elastic mode; returns a :class:`hvdtrain.trainer.TrainResult`."""
    from hvdtrain.elastic_state import TrainingState
    from hvdtrain.trainer import TrainResult, make_dataset, write_summary

    dataset = make_dataset(cfg)
    engine = make_engine(cfg.framework)
    engine.prepare(cfg, dataset)
    position, error = Position(), ""
    if engine.rank == 0:
        position, error = _start_on_rank0(cfg, engine, resume_from)
    backend = backend_for(cfg.framework)
    state = TrainingState(engine, backend, cfg, position, error)
    driver = ElasticDriver(cfg, engine, dataset, resumed=resume_from is not None)
    watchdog = StallWatchdog(cfg.train.stall_timeout_s, cfg.run_dir, engine.rank, engine.size,
                             before_exit=driver.flush_metrics)
    try:
        with StopRequest() as stop, watchdog as dog:
            summary = backend.run(driver)(state, stop, dog.beat)
        if driver.logger is not None:
            driver.logger.summary(summary)
    finally:
        if driver.logger is not None:
            driver.logger.close()
        driver.checkpoints.wait()
    if engine.rank == 0:
        write_summary(cfg.run_dir, summary)
        state.record.write(cfg.run_dir / "indices")
    assert driver.loop is not None
    return TrainResult(summary=summary, run_dir=cfg.run_dir, local_eval=driver.loop.local_eval,
                       engine=engine)
