"""Keras 3 ``model.fit`` on hvdtrain: :class:`KerasFit` and its callbacks (docs/own-loop.md).

``fit``'s own loop runs the step; Horovod's Keras ``DistributedOptimizer`` (which runs on Keras 3
with hvdtrain's Horovod patches) averages the gradients. Everything else is the config-driven
trainer's own code: the engine's state I/O and broadcast (:class:`FitEngine` is
:class:`~hvdtrain.tensorflow.engine.TensorFlowEngine` around the user's model and optimizer), the
global-batch sampler, the learning-rate schedule, the checkpoint manager and its resume path, the
stop signals and the metric sinks::

    run = KerasFit("configs/digits_tf.yaml")
    model.compile(optimizer=run.optimizer(), loss=..., metrics=[...], jit_compile=False)
    run.setup(model)                                  # resume, then rank 0's state everywhere
    model.fit(run.dataset(x, y), epochs=run.epochs, initial_epoch=run.initial_epoch,
              steps_per_epoch=run.steps_per_epoch, callbacks=run.callbacks(),
              verbose=2 if run.rank == 0 else 0)
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import horovod.tensorflow.keras as hvd_keras
import keras
import numpy as np
import tensorflow as tf

from hvdtrain.checkpoint import CheckpointManager
from hvdtrain.config import Config, load_config
from hvdtrain.data.sampler import EpochPlan, ShardedSampler
from hvdtrain.driver import start_on_rank0
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import GradientExchange, empty_stats
from hvdtrain.loop import Position, make_sampler, total_steps
from hvdtrain.observe.records import MetricsLogger, make_logger
from hvdtrain.rundir import RunDir
from hvdtrain.schedule import lr_at
from hvdtrain.session import Start
from hvdtrain.signals import EXIT_RESUBMIT, StopRequest
from hvdtrain.tensorflow.collectives import any_rank
from hvdtrain.tensorflow.engine import TensorFlowEngine, make_optimizer
from hvdtrain.world import World

_COMPRESSION = {"none": hvd_keras.Compression.none, "fp16": hvd_keras.Compression.fp16}


class KerasDistributed(GradientExchange):
    """Horovod's Keras ``DistributedOptimizer`` inside ``fit``, as the engine's exchange: it keeps
    no state of its own, so checkpoints and broadcasts hold the model and optimizer only."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.stats = rank, size, empty_stats()

    def run(self, grads: Sequence[Any]) -> list[Any]:
        raise HvdtrainError("KerasFit: fit's DistributedOptimizer exchanges the gradients")

    def any_rank(self, flag: bool) -> bool:
        return any_rank(flag)

    def updating(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        self.rank, self.size = rank, size


class FitEngine(TensorFlowEngine):
    """The trainer's TensorFlow engine around a user's compiled model: its state I/O (model and
    optimizer variables, random states) and broadcast are :class:`TensorFlowEngine`'s."""

    def __init__(self, cfg: Config) -> None:  # no super(): it would build a model and loader
        self._start(cfg)
        keras.utils.set_random_seed(cfg.seed + self.rank)  # as the trainer, before the model
        self.accumulation = 1
        self.exchange = KerasDistributed(self.rank, self.size)

    def attach(self, model: keras.Model) -> None:
        """Takes the compiled ``model`` and builds its optimizer's variables (so that a restore
        and the broadcast reach them before the first step)."""
        if getattr(model, "optimizer", None) is None:
            raise HvdtrainError("KerasFit.setup(model): compile the model first, with "
                                "optimizer=run.optimizer(...)")
        self.model, self.optimizer = model, model.optimizer
        self.optimizer.build(model.trainable_variables)

    def _follow_world(self) -> None:
        """Nothing traced to follow: fit traces its own step."""


class KerasFit:
    """hvdtrain under Keras's ``model.fit``; every rank makes one (see the module docstring).

    ``config`` and ``overrides`` are ``hvdtrain train``'s (None: the defaults, with
    ``framework=tensorflow``). What applies:
    ``seed``, ``data.batch_size`` (per rank) and ``shuffle``, ``train.epochs``, ``optim`` (with
    :meth:`optimizer` and no argument: its learning-rate schedule is set every batch),
    ``comm.compression`` (``none`` or ``fp16``: Horovod's Keras optimizer), ``checkpoint`` and
    ``log``. Starts Horovod and seeds Keras with ``seed + rank``, as the trainer does.
    """

    def __init__(self, config: str | Path | None = None, overrides: Sequence[str] = ()) -> None:
        # No config file: the defaults, for TensorFlow (theirs are PyTorch's).
        first = ["framework=tensorflow"] if config is None else []
        self.cfg = cfg = load_config(config, [*first, *overrides])
        refuse_unsupported(cfg)
        self.engine = FitEngine(cfg)
        self.run_dir = RunDir(cfg.run_dir)
        self.checkpoints = CheckpointManager(cfg.checkpoint, self.run_dir.checkpoints)
        self.position = Position()
        self.resumed = False
        self.schedule = False
        self.sampler: ShardedSampler | None = None
        self.saved_step = -1
        self.logger: MetricsLogger | None = None
        self.stop = StopRequest().__enter__()  # until the end of fit (or close())

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.engine.rank

    @property
    def size(self) -> int:
        """The number of ranks."""
        return self.engine.size

    @property
    def epochs(self) -> int:
        """``train.epochs``: fit's ``epochs``."""
        return self.cfg.train.epochs

    @property
    def initial_epoch(self) -> int:
        """The epoch a resumed run continues (fit's ``initial_epoch``)."""
        return self.position.epoch

    def optimizer(self, optimizer: keras.optimizers.Optimizer | None = None) -> Any:
        """Horovod's Keras ``DistributedOptimizer`` around ``optimizer`` (None: the config's
        ``optim``, whose schedule the callbacks then set every batch)."""
        self.schedule = optimizer is None
        inner = optimizer or make_optimizer(self.cfg.optim)
        return hvd_keras.DistributedOptimizer(inner,
                                              compression=_COMPRESSION[self.cfg.comm.compression])

    def setup(self, model: keras.Model) -> keras.Model:
        """Resumes as ``checkpoint.resume`` says (rank 0 reads), then gives every rank rank 0's
        model and optimizer state (one broadcast)."""
        self.engine.attach(model)
        start = start_on_rank0(self.cfg, self.run_dir, self.engine) if self.rank == 0 else Start()
        start = self.engine.collectives.broadcast_object(start)
        if start.error:
            raise start.error
        self.engine.broadcast_state()
        if start.resumed:
            self.position, self.resumed = start.position, True
            self.saved_step = start.position.step
        return model

    def dataset(self, x: Any, y: Any) -> tf.data.Dataset:
        """This rank's batches of ``(x, y)`` (arrays of one length), drawn by hvdtrain's global
        batch sampler: ``data.batch_size`` samples per rank and step, each epoch's permutation by
        ``(seed, epoch)``, a resumed epoch from where it stopped. One stream over every epoch
        left: give fit :attr:`steps_per_epoch` (Keras takes an unsized stream's first epoch, a
        resumed one's rest, for the length of all)."""
        x, y = np.asarray(x), np.asarray(y)
        self.sampler = make_sampler(self.cfg, len(x), 1)
        signature = (tf.TensorSpec((None, *x.shape[1:]), tf.as_dtype(x.dtype)),
                     tf.TensorSpec((None, *y.shape[1:]), tf.as_dtype(y.dtype)))

        def batches() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for plan in self._plans():
                for step in plan:
                    yield x[step.micro[0]], y[step.micro[0]]

        return tf.data.Dataset.from_generator(batches, output_signature=signature)

    def _plans(self) -> Iterator[EpochPlan]:
        """This rank's steps of every epoch left, from the position's (read once, as the stream
        opens: tf.data fetches ahead of the step that trains)."""
        assert self.sampler is not None
        epoch, start = self.position.epoch, self.position.in_epoch
        while True:
            yield self.sampler.steps(epoch, self.rank, self.size, start)
            epoch, start = epoch + 1, 0

    @property
    def steps_per_epoch(self) -> int:
        """Steps of a whole epoch (fit's ``steps_per_epoch``); call :meth:`dataset` first."""
        if self.sampler is None:
            raise HvdtrainError("KerasFit.steps_per_epoch: call run.dataset(x, y) first")
        return self.sampler.steps_in_epoch(self.size)

    def callbacks(self) -> list[keras.callbacks.Callback]:
        """Metric averaging over the ranks (Horovod's callback), then hvdtrain's: the schedule,
        the position, checkpoints, stop signals and the sinks."""
        return [hvd_keras.callbacks.MetricAverageCallback(), FitCallback(self)]

    @property
    def total_steps(self) -> int:
        """The step at which ``train.epochs`` (capped by ``train.max_steps``) end."""
        if self.sampler is None:
            return self.cfg.train.max_steps
        return total_steps(self.cfg.train, self.sampler, self.size,
                           dataclasses.replace(self.position))

    def lr(self) -> float:
        """The config's learning rate for the coming step (warm-up, scaling, schedule)."""
        world = World.of(self.cfg, self.size)
        return lr_at(self.position.step, self.total_steps, self.cfg.optim, self.size,
                     base_lr=world.lr)

    def advance(self) -> None:
        """After a step of fit: the position moves by the step's global batch."""
        pos, sampler = self.position, self.sampler
        pos.step += 1
        if sampler is None:
            return
        count = min(sampler.step_samples(self.size), sampler.num_samples - pos.in_epoch)
        pos.in_epoch += count
        pos.samples += count
        if pos.in_epoch >= sampler.num_samples:
            pos.epoch, pos.in_epoch = pos.epoch + 1, 0

    def log(self, record: dict[str, Any]) -> None:
        """Writes ``record`` (already averaged) to every configured sink, on rank 0."""
        if self.logger is None:
            self.logger = make_logger(self.cfg, self.run_dir, self.rank == 0, self.total_steps,
                                      start_step=self.position.step, resumed=self.resumed)
        self.logger.log(record)

    def save(self) -> Path | None:
        """Checkpoints the model, optimizer, random states and the position (every rank calls
        it; rank 0 writes atomically). Returns the path on rank 0."""
        if self.logger is not None:
            self.logger.flush()
        meta = {"position": dataclasses.asdict(self.position), "world_size": self.size,
                "framework": "tensorflow", "config": self.cfg.to_dict()}
        self.saved_step = self.position.step
        return self.checkpoints.save(self.engine, self.rank, self.position.step, meta)

    def stop_agreed(self) -> bool:
        """Whether any rank was asked to stop (one small allreduce)."""
        return self.engine.exchange.any_rank(self.stop())

    def close(self) -> None:
        """The sinks closed, the last checkpoint on disk, the signal handlers restored."""
        try:
            if self.logger is not None:
                self.logger.close()
                self.logger = None
        finally:
            self.checkpoints.wait()
            self.stop.__exit__(None, None, None)


class FitCallback(keras.callbacks.Callback):
    """hvdtrain's part of ``fit``: the config's learning rate before each batch; after it the
    position, periodic checkpoints and stop requests (agreed at each log interval: then a
    checkpoint and exit 75); each epoch's averaged metrics to the sinks; a checkpoint at the end."""

    def __init__(self, run: KerasFit) -> None:
        super().__init__()
        self.run = run

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.run.schedule:
            self.run.engine.optimizer.learning_rate.assign(self.run.lr())

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        run = self.run
        run.advance()
        step = run.position.step
        if run.checkpoints.due(step):
            run.save()
        if step % run.cfg.log.every_steps == 0 and run.stop_agreed():
            self._stop()
        if step >= run.total_steps:  # a resumed run's epochs end inside fit's last one
            self.model.stop_training = True

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        record = {"step": self.run.position.step, "epoch": self.run.position.epoch,
                  **{key: float(value) for key, value in (logs or {}).items()}}
        self.run.log(record)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.run.cfg.checkpoint.enabled and self.run.saved_step != self.run.position.step:
            self.run.save()
        self.run.close()

    def _stop(self) -> None:
        run = self.run
        if run.saved_step != run.position.step:
            run.save()
        run.checkpoints.share_failure(run.engine.collectives, run.rank)
        where = run.checkpoints.path_for(run.position.step) if run.cfg.checkpoint.enabled \
            else "not written"
        run.close()
        print(f"hvdtrain: stopped on request at step {run.position.step}; checkpoint {where}; "
              "resubmit with checkpoint.resume=auto to continue", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_RESUBMIT)


def refuse_unsupported(cfg: Config) -> None:
    """One-line refusals of what :class:`KerasFit` does not do."""
    if cfg.framework != "tensorflow":
        raise HvdtrainError(f"framework={cfg.framework!r}: KerasFit trains Keras models; set "
                            "framework=tensorflow")
    if cfg.comm.compression not in _COMPRESSION:
        raise HvdtrainError(f"comm.compression={cfg.comm.compression!r}: model.fit exchanges "
                            "through Horovod's Keras optimizer (none or fp16); the TensorFlow "
                            "trainer (`hvdtrain train`) runs the others")
    for key, bad in (("elastic.enabled", cfg.elastic.enabled),
                     ("train.backward_passes_per_step", cfg.train.backward_passes_per_step > 1),
                     ("pipeline.stages", cfg.pipeline.stages > 1),
                     ("comm.topology", cfg.comm.topology != "ring"),
                     ("shard.stage", bool(cfg.shard.stage))):
        if bad:
            raise HvdtrainError(f"{key}: not supported under model.fit (KerasFit); use "
                                "`hvdtrain train`")
