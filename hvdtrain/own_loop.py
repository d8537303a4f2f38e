"""What the own-loop APIs of both frameworks share without a framework (docs/own-loop.md):
:class:`hvdtrain.torch.api.Trainer` and :class:`hvdtrain.tensorflow.tape.TapeTrainer`."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hvdtrain.checkpoint import CheckpointManager
from hvdtrain.config import Config
from hvdtrain.data.sampler import EpochPlan, StepIndices
from hvdtrain.driver import find_checkpoint, restore
from hvdtrain.errors import HvdtrainError
from hvdtrain.loop import Position
from hvdtrain.observe.records import MetricsLogger, make_logger
from hvdtrain.rundir import RunDir
from hvdtrain.session import Start
from hvdtrain.signals import EXIT_RESUBMIT, StopRequest

STEP_KEY = "hvdtrain.step"
"""The key under which :func:`check_same_step`'s step rides along in an API's metric allreduce."""


def check_same_step(total: float, step: int, size: int, where: str) -> None:
    """``total`` is the sum of every rank's step at a collective of the API: unequal steps mean
    the ranks called the loop's collectives in a different order; one line, not a hang later."""
    if total != step * size:
        raise HvdtrainError(f"trainer.{where}() at step {step} on this rank, but the ranks' "
                            f"steps add up to {total:g}: every rank must run the same steps and "
                            f"call {where}() at the same ones")


class OwnLoop:
    """The bookkeeping both frameworks' own-loop APIs share: the run's position, the log, the
    checkpoints and resume, and the stop on request. A subclass sets the attributes below in
    its ``__init__`` and provides ``total_steps`` and ``close``."""

    cfg: Config
    engine: Any
    """The framework's engine around the user's model (``TorchEngine``, ``TensorFlowEngine``)."""
    run_dir: RunDir
    checkpoints: CheckpointManager
    position: Position
    resumed: bool
    objects: dict[str, Any]
    plan: EpochPlan | None
    cursor: int
    logger: MetricsLogger | None
    saved_step: int
    stop: StopRequest

    elastic_state: Any = None
    """Elastic mode's state (:class:`hvdtrain.own_loop_elastic.LoopState`), made by ``setup``
    when ``elastic.enabled``; None otherwise."""
    elastic_entered = False

    @property
    def total_steps(self) -> int:
        raise NotImplementedError

    # -- elastic mode -------------------------------------------------------------------------

    def elastic(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorates the function that holds the training loop: under ``elastic.enabled`` a call
        runs it inside Horovod's elastic runner, again from the last commit after every reset
        (workers lost or added), at the new world size; without, a call runs it once."""
        def run(*args: Any, **kwargs: Any) -> Any:
            if not self.cfg.elastic.enabled:
                return fn(*args, **kwargs)
            if self.elastic_state is None:
                raise HvdtrainError("an @trainer.elastic function before trainer.setup(model)")
            from hvdtrain.own_loop_elastic import run_elastic
            self.elastic_entered = True
            return run_elastic(self, fn, args, kwargs)
        return run

    def check_elastic(self, step: StepIndices | None, where: str) -> None:
        """Under elastic mode, one line for a step outside the elastic function or outside
        hvdtrain's sampler: neither could be restarted with each sample seen once."""
        if self.elastic_state is None:
            return
        if not self.elastic_entered:
            raise HvdtrainError(f"elastic.enabled=true: trainer.{where}() outside the training "
                                "function; decorate the function that holds the loop with "
                                "@trainer.elastic and call it")
        if step is None:
            raise HvdtrainError(f"elastic.enabled=true: trainer.{where}() on a batch that is not "
                                "from the trainer's loader: only hvdtrain's sampler re-shards "
                                "the epoch's rest after a reset, so that each sample is seen once")

    def restart_from(self, position: Position, reset: bool) -> None:
        """Elastic mode: the loop starts (again, after a ``reset``) from a committed position."""
        self.position = dataclasses.replace(position)
        self.resumed = self.resumed or reset
        self.plan, self.cursor = None, 0
        self._restart()

    def _restart(self) -> None:
        """A framework's own per-step bookkeeping back to a step's start (after a reset)."""

    def _commit_if_due(self) -> None:
        """Elastic mode: commits the state at this step boundary every ``elastic.commit_every``
        steps (may raise Horovod's interrupt, when hosts were added or removed)."""
        state = self.elastic_state
        if state is None or self.position.step - state.position.step < \
                self.cfg.elastic.commit_every:
            return
        if self.logger is not None:  # a new rank 0 keeps the records up to the commit
            self.logger.flush()
        state.commit_at(self.position)

    def close(self) -> None:
        raise NotImplementedError

    def epochs(self) -> range:
        """The epochs left to train: from the resumed one to ``train.epochs``."""
        return range(self.position.epoch, self.cfg.train.epochs)

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.engine.rank

    @property
    def size(self) -> int:
        """The number of ranks."""
        return self.engine.size

    def _current(self) -> StepIndices | None:
        if self.plan is None or self.cursor >= len(self.plan):
            return None
        return self.plan.steps[self.cursor]

    def _stop(self) -> None:
        """Checkpoints (once) and exits 75 on every rank, as ``hvdtrain train`` does."""
        if self.saved_step != self.position.step:
            self.save()
        self.checkpoints.share_failure(self.engine.collectives, self.engine.rank)
        where = self.checkpoints.path_for(self.position.step) if self.cfg.checkpoint.enabled \
            else "not written"
        self.close()
        print(f"hvdtrain: stopped on request at step {self.position.step}; checkpoint {where}; "
              "resubmit with checkpoint.resume=auto to continue", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_RESUBMIT)

    def log(self, metrics: Mapping[str, float], step: int | None = None) -> dict[str, float]:
        """Averages ``metrics`` over the ranks (one allreduce; with a ``count`` key, weighted by
        it, as the trainer's sums) and writes them to every configured sink on rank 0; returns
        the averages on every rank."""
        sums = {key: float(value) for key, value in metrics.items()}
        sums[STEP_KEY] = float(self.position.step)  # the ranks must log at the same step
        total = self.engine.collectives.allreduce_sums(sums)
        check_same_step(total.pop(STEP_KEY), self.position.step, self.engine.size, "log")
        if "count" in total:
            count = max(total.pop("count"), 1.0)
            averaged = {key: value / count for key, value in total.items()}
        else:
            averaged = {key: value / self.engine.size for key, value in total.items()}
        record = {"step": self.position.step if step is None else step,
                  "epoch": self.position.epoch, **averaged}
        self._logger().log(record)
        return averaged

    def _logger(self) -> MetricsLogger:
        if self.logger is None:
            self.logger = make_logger(self.cfg, self.run_dir, self.engine.rank == 0,
                                      self.total_steps, start_step=self.position.step,
                                      resumed=self.resumed)
        return self.logger

    def save(self) -> Path | None:
        """Checkpoints the model, optimizer, exchange state, loss scaler, random states, the
        position in the data and the ``setup`` objects (every rank calls it; rank 0 writes
        ``step-<step>.ckpt`` atomically, with its manifest). Returns the path on rank 0."""
        if self.logger is not None:
            self.logger.flush()
        meta = {"position": dataclasses.asdict(self.position), "world_size": self.engine.size,
                "framework": self.cfg.framework, "config": self.cfg.to_dict(),
                "objects": {name: obj.state_dict() for name, obj in self.objects.items()}}
        self.saved_step = self.position.step
        # holds=False: these APIs hold no failures of other writes (only the trainer's loop does).
        return self.checkpoints.save(self.engine, self.engine.rank, self.position.step, meta,
                                     holds=False)

    def load(self, path: str | Path | None = None) -> bool:
        """Restores ``path`` (None: ``checkpoint.resume``'s choice, else the newest valid
        checkpoint of the run) on every rank; returns whether one was restored."""
        if self.engine.rank != 0:
            return self._share(Start())
        try:
            found = Path(path) if path else (find_checkpoint(self.cfg, self.run_dir)
                                             or self.checkpoints.latest_valid())
            start = Start(restore(self.engine, found, self.cfg), resumed=True) if found \
                else Start()
        except HvdtrainError as exc:
            start = Start(error=exc)
        return self._share(start)

    def _share(self, start: Start) -> bool:
        """Gives every rank rank 0's start, state and objects (one broadcast each)."""
        objects = self.engine.last_meta.get("objects", {}) if start.resumed else {}
        start, objects = self.engine.collectives.broadcast_object((start, objects))
        if start.error:
            raise start.error
        self.engine.broadcast_state()
        missing = sorted(set(self.objects) - set(objects)) if start.resumed else []
        if missing:
            raise HvdtrainError(f"checkpoint holds no state for setup object(s) {missing}")
        for name, obj in self.objects.items():
            if start.resumed:
                obj.load_state_dict(objects[name])
        if start.resumed:
            self.position, self.resumed = start.position, True
            self.plan, self.saved_step = None, start.position.step
        return bool(start.resumed)

