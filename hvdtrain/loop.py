"""The framework-free training loop: epochs, steps, logging, evaluation and checkpoints.

It talks to an :class:`~hvdtrain.engine.Engine` only, so the PyTorch and TensorFlow trainers share
every decision made here. All ranks run the same sequence of engine calls; metrics are summed over
ranks by one allreduce per log interval (not per step) and divided by the global sample count, so
the logged values are exact cross-rank averages weighted by samples.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hvdtrain.checkpoint import CheckpointManager
from hvdtrain.config import Config
from hvdtrain.data import Dataset, ShardedSampler, eval_shards
from hvdtrain.engine import Engine
from hvdtrain.metrics import MetricsLogger
from hvdtrain.schedule import lr_at


def means(sums: dict[str, float], prefix: str = "") -> dict[str, float]:
    """Turns summed metrics into means over ``count`` (``loss`` and ``correct`` -> ``accuracy``)."""
    count = max(sums.get("count", 0.0), 1.0)
    out = {}
    for key, value in sums.items():
        if key == "count":
            continue
        out[prefix + ("accuracy" if key == "correct" else key)] = value / count
    return out


@dataclass
class Window:
    """Local metric sums since the last log, with the steps, global samples and time they took."""

    sums: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    samples: int = 0
    started: float = field(default_factory=time.perf_counter)

    def add(self, sums: dict[str, float], samples: int) -> None:
        """Adds one step's local sums and its global sample count."""
        for key, value in sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.steps += 1
        self.samples += samples


def total_steps(cfg: Config, steps_per_epoch: int) -> int:
    """Optimizer steps of the whole run: all epochs, capped by ``train.max_steps``."""
    steps = cfg.train.epochs * steps_per_epoch
    return min(steps, cfg.train.max_steps) if cfg.train.max_steps else steps


class Loop:
    """Runs training for one config on one engine; every rank constructs and runs it."""

    def __init__(self, cfg: Config, engine: Engine, dataset: Dataset,
                 checkpoints: CheckpointManager) -> None:
        self.cfg, self.engine, self.checkpoints = cfg, engine, checkpoints
        self.logger = MetricsLogger([])
        self.num_test = len(dataset.test())
        self.sampler = ShardedSampler(len(dataset.train()), cfg.data.batch_size,
                                      accumulation=cfg.train.backward_passes_per_step,
                                      seed=cfg.seed, shuffle=cfg.data.shuffle)
        self.steps_per_epoch = self.sampler.steps_in_epoch(engine.size)
        self.total_steps = total_steps(cfg, self.steps_per_epoch)
        self.step = 0
        self.samples = 0
        self.fingerprint = hashlib.sha256()
        self.train_seconds = 0.0
        self.last_train: dict[str, float] = {}
        self.pending: tuple[dict[str, Any], Callable[[], dict[str, float]]] | None = None
        self.last_eval: dict[str, float] = {}
        self.local_eval: dict[str, float] = {}

    def run(self, logger: MetricsLogger) -> dict[str, Any]:
        """Trains to the end, logging to ``logger``, and returns the summary (the same on every rank)."""
        self.logger = logger
        started = time.perf_counter()
        epoch = 0
        while self.step < self.total_steps:
            self._train_epoch(epoch)
            epoch += 1
        return self._summary(epoch, time.perf_counter() - started)

    def _train_epoch(self, epoch: int) -> None:
        window = Window()
        for indices in self.sampler.steps(epoch, self.engine.rank, self.engine.size):
            lr = lr_at(self.step, self.total_steps, self.cfg.optim, self.engine.size)
            tick = time.perf_counter()
            window.add(self.engine.train_step(indices, lr), indices.global_count)
            self.train_seconds += time.perf_counter() - tick
            self._flush()
            self.step += 1
            self.samples += indices.global_count
            for micro in indices.micro:
                self.fingerprint.update(micro.astype("<i8").tobytes())
            last = self.step == self.total_steps or self.step % self.steps_per_epoch == 0
            if last:
                break
            if self.step % self.cfg.log.every_steps == 0:
                self._log(window, epoch, lr)
                window = Window()
            if self.checkpoints.due(self.step):
                self._checkpoint(epoch)
        self._end_epoch(window, epoch, lr)

    def _end_epoch(self, window: Window, epoch: int, lr: float) -> None:
        finished = self.step == self.total_steps
        evals = {}
        if finished or (epoch + 1) % self.cfg.train.eval_every_epochs == 0:
            evals = self._evaluate()
        self._log(window, epoch, lr, evals)
        self._flush()
        if finished or self.checkpoints.due(self.step):
            self._checkpoint(epoch)

    def _log(self, window: Window, epoch: int, lr: float, extra: dict[str, float] | None = None) -> None:
        """Starts the cross-rank sum of the window's metrics; :meth:`_flush` logs the record."""
        seconds = time.perf_counter() - window.started
        record = {"step": self.step, "epoch": epoch, "lr": lr, **(extra or {}),
                  "samples_per_sec": window.samples / seconds,
                  "step_time_s": seconds / max(window.steps, 1)}
        self.pending = (record, self.engine.start_allreduce_sums(window.sums))

    def _flush(self) -> None:
        """Waits for the pending metric sum (started one step earlier) and logs its record."""
        if self.pending is None:
            return
        record, result = self.pending
        self.pending = None
        self.last_train = means(result())
        self.logger.log({**record, **self.last_train})

    def _evaluate(self) -> dict[str, float]:
        shards = eval_shards(self.num_test, self.engine.rank, self.engine.size,
                             self.cfg.data.eval_batch_size)
        self.local_eval = self.engine.evaluate(shards)
        self.last_eval = means(self.engine.allreduce_sums(self.local_eval), prefix="eval_")
        return self.last_eval

    def _checkpoint(self, epoch: int) -> None:
        meta = {"epoch": epoch, "framework": self.engine.framework, "config": self.cfg.to_dict()}
        self.checkpoints.save(self.engine, self.step, meta)

    def _summary(self, epochs: int, wall: float) -> dict[str, Any]:
        train = {f"train_{k}": v for k, v in self.last_train.items()}
        return {
            "name": self.cfg.name, "framework": self.engine.framework,
            "world_size": self.engine.size, "steps": self.step, "epochs": epochs,
            "samples": self.samples, "wall_time_s": wall, "train_time_s": self.train_seconds,
            "samples_per_sec": self.samples / max(self.train_seconds, 1e-9),
            "compression": self.cfg.comm.compression,
            "data_fingerprint": self.fingerprint.hexdigest()[:16],
            "final": {**self.last_eval, **train},
            "versions": self.engine.versions(),
        }
