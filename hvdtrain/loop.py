"""The framework-free training loop: epochs, steps, logging, evaluation and checkpoints.

It talks to an :class:`~hvdtrain.engine.Engine` only, so the PyTorch and TensorFlow trainers share
every decision made here. All ranks run the same sequence of engine calls; metrics are summed over
ranks by one allreduce per log interval (not per step) and divided by the global sample count, so
the logged values are exact cross-rank averages weighted by samples.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.checkpoint import CheckpointManager
from hvdtrain.config import Config, TrainConfig
from hvdtrain.controls import Controls
from hvdtrain.data.contracts import Dataset
from hvdtrain.data.sampler import ShardedSampler, StepIndices, eval_shards
from hvdtrain.engine import Engine
from hvdtrain.errors import Diverged, HvdtrainError
from hvdtrain.observe.ranks import Monitor, StepCosts
from hvdtrain.observe.records import MetricsLogger
from hvdtrain.observe.system import process_age_s
from hvdtrain.precision import SkippedSteps
from hvdtrain.schedule import lr_at
from hvdtrain.world import World

Derived = Mapping[str, Callable[[Mapping[str, float]], float]]
"""Metrics computed from the averaged ones, by name: the model adapter's ``derived_metrics``
(the language models' ``perplexity``, ``exp(loss)``)."""


def means(sums: dict[str, float], prefix: str = "", derived: Derived | None = None
          ) -> dict[str, float]:
    """Turns summed metrics into means over ``count`` (``loss`` and ``correct`` -> ``accuracy``),
    then adds each ``derived`` metric, computed from those means (before ``prefix``)."""
    count = max(sums.get("count", 0.0), 1.0)
    out = {}
    for key, value in sums.items():
        if key == "count":
            continue
        out["accuracy" if key == "correct" else key] = value / count
    for name, compute in (derived or {}).items():
        out[name] = compute(out)
    return {prefix + key: value for key, value in out.items()}


def derived_metrics(engine: Engine) -> Derived:
    """What the engine's model adapter declares as ``derived_metrics`` (none for an engine or
    adapter without)."""
    return dict(getattr(getattr(engine, "adapter", None), "derived_metrics", None) or {})


@dataclass
class Window:
    """Local metric sums since the last log, with the steps, global samples and time they took,
    and this rank's step costs (time in ``train_step``, the engine's step stats)."""

    sums: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    samples: int = 0
    started: float = field(default_factory=time.perf_counter)
    costs: StepCosts = field(default_factory=StepCosts)

    def add(self, sums: dict[str, float], samples: int, seconds: float = 0.0,
            stats: dict[str, float] | None = None) -> None:
        """Adds one step's local sums, its global sample count, its time and its step stats."""
        for key, value in sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.steps += 1
        self.samples += samples
        self.costs.add(seconds, stats or {})


@dataclass
class Position:
    """Where a run stands; saved in every checkpoint and restored on resume.

    ``in_epoch`` counts the samples of ``epoch`` already trained on. It does not depend on the world
    size, so a run resumed at another size continues the same epoch with the rest of its samples.
    """

    step: int = 0
    epoch: int = 0
    in_epoch: int = 0
    samples: int = 0


class Callback:
    """Hooks into the loop, every one a no-op here: subclass and override what you need.

    Every rank calls them at the same points. Elastic mode commits its state through them; a
    benchmark or a user's code can observe the run through them without touching the loop.
    """

    def on_step_start(self, step: int) -> None:
        """Before optimizer step ``step + 1`` (``step`` steps are done)."""

    def on_step_end(self, epoch: int, indices: StepIndices) -> None:
        """After each optimizer step: its epoch and this rank's sample indices."""

    def on_boundary(self, position: Position) -> None:
        """At each step boundary from which the run could continue (never inside an epoch's last
        step, whose evaluation and epoch change are still to come)."""

    def on_evaluate_start(self) -> None:
        """Before the test split is scored."""

    def on_epoch_end(self, epoch: int) -> None:
        """After an epoch's last step, its evaluation, record and checkpoint."""


class Stopped(Exception):
    """Training stopped early on request (a signal) after a checkpoint at a step boundary."""

    def __init__(self, step: int, checkpoint: Path | None) -> None:
        super().__init__(f"stopped on request at step {step}; checkpoint {checkpoint or 'not written'}")
        self.step, self.checkpoint = step, checkpoint


def total_steps(train: TrainConfig, sampler: ShardedSampler, size: int, pos: Position) -> int:
    """The step at which a run standing at ``pos`` ends at world size ``size``: its epochs from
    where it stands, capped by ``train.max_steps``."""
    epochs, left = train.epochs, 0
    if pos.epoch < epochs:
        left = (sampler.steps_in_epoch(size, pos.in_epoch)
                + (epochs - pos.epoch - 1) * sampler.steps_in_epoch(size))
    total = pos.step + left
    return min(total, train.max_steps) if train.max_steps else total


def make_sampler(cfg: Config, num_train: int, accumulation: int) -> ShardedSampler:
    """The global-batch sampler of ``cfg`` over ``num_train`` samples, each rank accumulating
    ``accumulation`` micro-batches a step (:attr:`hvdtrain.world.World.accumulation`)."""
    return ShardedSampler(num_train, cfg.data.batch_size, accumulation=accumulation,
                          seed=cfg.seed, shuffle=cfg.data.shuffle)


class Loop:
    """Runs training for one config on one engine in one :class:`~hvdtrain.world.World`; every
    rank constructs and runs it.

    ``total`` is :func:`total_steps` of ``start``, computed by the caller, who needs it to build
    ``logger`` first.
    """

    def __init__(self, cfg: Config, world: World, engine: Engine, dataset: Dataset,
                 checkpoints: CheckpointManager, logger: MetricsLogger, *, start: Position, total: int,
                 stop_requested: Callable[[], bool] = lambda: False,
                 heartbeat: Callable[[], None] = lambda: None,
                 callbacks: Sequence[Callback] = ()) -> None:
        self.cfg, self.world, self.engine = cfg, world, engine
        self.checkpoints, self.logger = checkpoints, logger
        self.collectives = engine.collectives
        self.derived = derived_metrics(engine)
        self.callbacks = list(callbacks)
        self.num_train, self.num_test = len(dataset.train()), len(dataset.test())
        self.sampler = make_sampler(cfg, self.num_train, world.accumulation)
        self.pos = start
        self.heartbeat = heartbeat
        self.total_steps = total
        self.fingerprint = hashlib.sha256()
        self.train_seconds = 0.0
        # This process's age at the end of the loop's first step: imports, set-up, first trace.
        self.startup_s: float | None = None
        self.last_train: dict[str, float] = {}
        self.pending: tuple[dict[str, Any], int, Callable[[], dict[str, float]]] | None = None
        self.skipped = SkippedSteps()  # fp16 steps the loss scaler skipped: overflows, not divergence
        self.saved_step = -1
        self.started = time.perf_counter()  # reset by run(); records carry time since then
        self.last_eval: dict[str, float] = {}
        self.local_eval: dict[str, float] = {}
        log = cfg.log
        self.monitor = Monitor(engine.rank, engine.size, engine.local_rank, system=log.system,
                               straggler_factor=log.straggler_factor,
                               straggler_logs=log.straggler_steps, warn=logger.warn,
                               stages=engine.pipeline_stages())
        self.controls = Controls(engine.rank, engine.size, self.monitor,
                                 stop_requested=stop_requested, write_failed=checkpoints.failed)

    def run(self) -> dict[str, Any]:
        """Trains to the end and returns the summary (the same on every rank).

        Raises :class:`Stopped` on every rank, after a checkpoint, when a stop was requested.
        """
        started = self.started = time.perf_counter()
        while self.pos.step < self.total_steps:
            self._train_epoch(self.pos.epoch)
        if not self.last_eval:  # resumed at the very end: report the restored model's scores
            self._evaluate()
        # The last records and checkpoint are on disk, or their failure stops every rank here.
        self.write_metrics()
        self.checkpoints.share_failure(self.collectives, self.engine.rank)
        return self._summary(time.perf_counter() - started)

    def _train_epoch(self, epoch: int) -> None:
        window = Window()
        steps = self.sampler.steps(epoch, self.engine.data_rank, self.engine.data_size,
                                   self.pos.in_epoch)
        for indices in steps:
            lr = lr_at(self.pos.step, self.total_steps, self.cfg.optim, self.engine.data_size,
                       base_lr=self.world.lr)
            self._step(indices, lr, window)
            self._flush()
            self._advance(indices)
            if self.pos.step == self.total_steps or self.pos.in_epoch >= self.num_train:
                break
            if self.pos.step % self.cfg.log.every_steps == 0:
                self._log(window, epoch, lr)
                window = Window()
            if self.checkpoints.due(self.pos.step):
                self._checkpoint()
            if self.controls.stop_agreed:
                self._stop()
            for callback in self.callbacks:
                callback.on_boundary(self.pos)
        self._end_epoch(window, epoch, lr)

    def _step(self, indices: StepIndices, lr: float, window: Window) -> None:
        """One optimizer step, its sums and costs added to ``window``."""
        for callback in self.callbacks:
            callback.on_step_start(self.pos.step)
        tick = time.perf_counter()
        if self.engine.rank == self.cfg.train.slow_rank:  # a straggler on purpose, in its step
            time.sleep(self.cfg.train.slow_ms / 1000.0)
        sums = self.engine.train_step(indices, lr)
        seconds = time.perf_counter() - tick
        if self.startup_s is None:
            self.startup_s = process_age_s()
        stats = self.engine.step_stats()
        sums = self._skip_check(sums, bool(stats.get("skipped")))
        window.add(sums, indices.global_count, seconds, stats)
        self.train_seconds += seconds
        self.heartbeat()
        self.controls.note_loss(self.pos.step + 1, sums["loss"])

    def _skip_check(self, sums: dict[str, float], skipped: bool) -> dict[str, float]:
        """A step the fp16 loss scaler skipped trained nothing: a non-finite loss there is the
        overflow the scaler handles, left out of the metrics. Too many skipped in a row is
        divergence: the loss is then reported as NaN."""
        if self.skipped.tolerated(skipped):
            return sums if math.isfinite(sums["loss"]) else {key: 0.0 for key in sums}
        return {**sums, "loss": math.nan} if skipped else sums

    def _advance(self, indices: StepIndices) -> None:
        self.pos.step += 1
        self.pos.in_epoch += indices.global_count
        self.pos.samples += indices.global_count
        for micro in indices.micro:
            self.fingerprint.update(np.ascontiguousarray(micro, dtype="<i8").data)  # no copy for int64
        for callback in self.callbacks:
            callback.on_step_end(self.pos.epoch, indices)

    def _end_epoch(self, window: Window, epoch: int, lr: float) -> None:
        finished = self.pos.step == self.total_steps
        evals = {}
        if finished or (epoch + 1) % self.cfg.train.eval_every_epochs == 0:
            evals = self._evaluate()
        self._log(window, epoch, lr, evals)
        self._flush()
        if self.pos.in_epoch >= self.num_train:
            self.pos.epoch, self.pos.in_epoch = epoch + 1, 0
        if finished or self.checkpoints.due(self.pos.step):
            self._checkpoint()
        if self.controls.stop_agreed and not finished:
            self._stop()
        for callback in self.callbacks:
            callback.on_boundary(self.pos)
            callback.on_epoch_end(epoch)

    def _log(self, window: Window, epoch: int, lr: float, extra: dict[str, float] | None = None) -> None:
        """Starts the cross-rank sum of the window's metrics, with the controls beside them
        (:mod:`hvdtrain.controls`); :meth:`_flush` logs the record."""
        seconds = time.perf_counter() - window.started
        record = {"step": self.pos.step, "epoch": epoch, "lr": lr, **(extra or {}),
                  "samples_per_sec": window.samples / seconds,
                  "time_s": time.perf_counter() - self.started,
                  "step_time_s": seconds / max(window.steps, 1)}
        sums = {**window.sums, **self.controls.outgoing(window.costs, window.steps)}
        self.pending = (record, window.steps, self.collectives.start_allreduce_sums(sums))

    def _flush(self) -> None:
        """Waits for the pending metric sum (started one step earlier) and logs its record."""
        if self.pending is None:
            return
        record, steps, result = self.pending
        self.pending = None
        agreed = self.controls.incoming(result(), steps, record["step"])
        self.last_train = means(agreed.sums, derived=self.derived)
        self._logged(lambda: self.logger.log({**record, **self.last_train, **agreed.health}))
        if agreed.write_failed:  # every rank raises rank 0's error here, together
            self.checkpoints.share_failure(self.collectives, self.engine.rank)
        self._check_finite(agreed.first_nonfinite)

    def write_metrics(self) -> None:
        """Logs the pending record (waiting for its sum) and writes out every record the logger
        holds back: before a checkpoint, and an elastic commit."""
        self._flush()
        self._logged(self.logger.flush)

    def _logged(self, write: Callable[[], None]) -> None:
        """Runs a write of the logger (rank 0's sinks); its failure (a full disk under
        ``metrics.jsonl``, the dashboards' writer) is held to stop every rank together at the next
        metrics sum or checkpoint, rather than rank 0 alone now."""
        try:
            write()
        except HvdtrainError as exc:
            self.checkpoints.hold_failure(exc)

    @staticmethod
    def _check_finite(first_bad: dict[int, int]) -> None:
        """Stops every rank when any saw a NaN or Inf loss, naming where it began; the allreduce
        spreads it to all ranks within a step, so only the first rank and step tell the cause."""
        seen = {rank: step for rank, step in first_bad.items() if step}
        if not seen:
            return
        step = min(seen.values())
        ranks = ", ".join(str(r) for r, s in seen.items() if s == step)
        raise Diverged(f"the loss became NaN or infinite on rank {ranks} at step {step}; "
                       "lower optim.lr, add warm-up or check the data")

    def _evaluate(self) -> dict[str, float]:
        for callback in self.callbacks:
            callback.on_evaluate_start()
        shards = eval_shards(self.num_test, self.engine.data_rank, self.engine.data_size,
                             self.cfg.data.eval_batch_size)
        self.local_eval = self.engine.evaluate(shards)
        self.last_eval = means(self.collectives.allreduce_sums(self.local_eval), prefix="eval_",
                               derived=self.derived)
        self.heartbeat()
        return self.last_eval

    def _checkpoint(self) -> Path | None:
        # The records up to this step go to disk first, so that a resume from this checkpoint,
        # which keeps the records up to its step, finds them all even if rank 0 is then killed.
        self.write_metrics()
        if self.controls.first_nonfinite:
            # NaN weights must not become the newest checkpoint that a resume would pick.
            warnings.warn(f"not checkpointing step {self.pos.step}: the loss was not finite since "
                          f"step {self.controls.first_nonfinite}", stacklevel=2)
            return None
        meta = {"position": dataclasses.asdict(self.pos), "world_size": self.engine.size,
                "framework": self.engine.framework, "config": self.cfg.to_dict()}
        self.saved_step = self.pos.step
        return self.checkpoints.save(self.engine, self.engine.rank, self.pos.step, meta)

    def _stop(self) -> None:
        if self.saved_step != self.pos.step:
            self._checkpoint()
        # Every rank waits until rank 0's checkpoint is on disk (or raises its failure): once the
        # first rank has exited 75, its launcher may end the others at once (horovodrun's SIGTERM,
        # srun --kill-on-bad-exit), rank 0 with its write still in flight.
        self.checkpoints.share_failure(self.collectives, self.engine.rank)
        enabled = self.cfg.checkpoint.enabled
        raise Stopped(self.pos.step, self.checkpoints.path_for(self.pos.step) if enabled else None)

    def _summary(self, wall: float) -> dict[str, Any]:
        train = {f"train_{k}": v for k, v in self.last_train.items()}
        return {
            "name": self.cfg.name, "framework": self.engine.framework,
            "world_size": self.engine.size, "steps": self.pos.step, "epochs": self.pos.epoch,
            "samples": self.pos.samples, "wall_time_s": wall, "train_time_s": self.train_seconds,
            "samples_per_sec": self.pos.samples / max(self.train_seconds, 1e-9),
            "compression": self.cfg.comm.compression, "precision": self.cfg.train.precision,
            **self.engine.placement(), "skipped_steps": self.skipped.total,
            "horovod_cycle_time_ms": float(self.engine.cycle_time_ms), **self.monitor.summary(),
            "data_fingerprint": self.fingerprint.hexdigest()[:16],
            "final": {**self.last_eval, **train},
            "versions": self.engine.versions(),
        }
