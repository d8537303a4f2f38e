"""Your own ``tf.GradientTape`` loop on hvdtrain: :class:`TapeTrainer` (docs/own-loop.md).

The TensorFlow twin of :class:`hvdtrain.torch.api.Trainer`. The loop stays the user's; beneath it
is the config-driven trainer's own code: the engine's state I/O and broadcast (:class:`TapeEngine`
is :class:`~hvdtrain.tensorflow.engine.TensorFlowEngine` around the user's model and optimizer),
the exchange the config selects (:func:`hvdtrain.tensorflow.exchange.make_exchange`), the step's
exchange and update (:func:`hvdtrain.step.exchange_and_update` over the trainer's traced update,
clipping, L2 and loss scale included), the global-batch sampler, the learning-rate schedule, the
checkpoint manager and its resume path, the stop signals and the metric sinks::

    trainer = TapeTrainer("configs/digits_tf.yaml", ["train.epochs=3"])
    model, optimizer = trainer.setup(model)          # optimizer: the config's, or pass your own
    batches = trainer.dataset(x, y)
    for epoch in trainer.epochs():
        batches.set_epoch(epoch)
        for xb, yb in batches:
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))   # the micro-batch's mean
            trainer.apply_gradients(tape, loss)
        trainer.log({"loss": ...})
    trainer.close()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.checkpoint import CheckpointManager
from hvdtrain.config import Config, load_config
from hvdtrain.data.sampler import EpochPlan
from hvdtrain.driver import start_on_rank0
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import ExchangeRequest
from hvdtrain.layout import dedicated
from hvdtrain.loop import Position, make_sampler, total_steps
from hvdtrain.observe.records import MetricsLogger
from hvdtrain.own_loop import OwnLoop
from hvdtrain.ps.mpi import ps_settings
from hvdtrain.rundir import RunDir
from hvdtrain.schedule import lr_at
from hvdtrain.session import Start
from hvdtrain.signals import StopRequest
from hvdtrain.step import exchange_and_update
from hvdtrain.tensorflow.engine import TensorFlowEngine, l2_decay, make_optimizer, optimizer_settings
from hvdtrain.tensorflow.exchange import applies_update, make_exchange
from hvdtrain.tensorflow.step import TensorFlowKernels, _traced
from hvdtrain.world import World


class TapeKernels(TensorFlowKernels):
    """The trainer's kernels without an adapter or loader: the user's tape takes the gradients,
    these hold them for the exchange and run the trainer's traced update (:meth:`_apply`)."""

    def _compile(self) -> None:
        specs = [tf.TensorSpec(v.shape, tf.float32) for v in self.model.trainable_variables]
        self.apply = _traced(self._apply, [specs])
        self.precision.attach(self.optimizer, self.apply, [tuple(s.shape) for s in specs])

    def take(self, grads: list[tf.Tensor]) -> None:
        """The step's gradients (accumulated over its micro-batches), ready to exchange."""
        self._grads = grads


class TapeEngine(TensorFlowEngine):
    """The trainer's TensorFlow engine around a user's model and optimizer: no model adapter and
    no loader; its broadcast, state I/O and exchange are :class:`TensorFlowEngine`'s."""

    def __init__(self, cfg: Config) -> None:  # no super(): it would build a model and loader
        self._start(cfg)
        keras.utils.set_random_seed(cfg.seed + self.rank)  # as the trainer, before the model
        self.accumulation = cfg.train.backward_passes_per_step
        self.stats: dict[str, float] = {}
        self.last_meta: dict[str, Any] = {}

    def attach(self, cfg: Config, model: keras.Model,
               optimizer: keras.optimizers.Optimizer) -> None:
        """Takes the built ``model``; wraps ``optimizer`` in the configured exchange and builds
        its variables (so that a restore and the broadcast reach them before the first step)."""
        if not model.built or not model.trainable_variables:
            raise HvdtrainError("TapeTrainer.setup(model): build the model first (keras.Input "
                                "or one call on a batch), so that its variables exist")
        self.model = model
        variables = model.trainable_variables
        self.exchange, stepping = make_exchange(cfg, ExchangeRequest(
            cfg.comm, cfg.seed, self.rank, self.size, variables, optimizer=optimizer,
            settings=optimizer_settings(cfg.optim), accumulation=self.accumulation,
            ps=ps_settings(cfg), shard=cfg.shard, layout=self.layout))
        plain = applies_update(self.exchange)
        self.optimizer = self.precision.wrap(stepping)
        self.optimizer.build(variables)
        self.kernels = TapeKernels(model, self.optimizer, None, None, self.precision,  # type: ignore[arg-type]
                                   None, l2=l2_decay(cfg.optim, plain))  # type: ignore[arg-type]
        self.kernels.clip_norm = cfg.optim.clip_norm
        self.kernels.follow(self.exchange, 1)  # the accumulation is the trainer's, in Python

    def load_state(self, data: bytes, where: str) -> dict[str, Any]:
        self.last_meta = super().load_state(data, where)
        return self.last_meta


class GlobalBatches:
    """This rank's micro-batches of ``(x, y)`` over hvdtrain's global batches, in order: every
    rank yields as many (a short step's may be empty). ``set_epoch`` picks the epoch's
    permutation, as ``DistributedSampler``'s does."""

    def __init__(self, trainer: TapeTrainer, x: Any, y: Any) -> None:
        self.trainer, self.x, self.y = trainer, np.asarray(x), np.asarray(y)
        if len(self.x) != len(self.y):
            raise HvdtrainError(f"TapeTrainer.dataset(x, y): {len(self.x)} inputs, "
                                f"{len(self.y)} targets")
        self.sampler = make_sampler(trainer.cfg, len(self.x), trainer.engine.accumulation)
        self.epoch = trainer.position.epoch

    def set_epoch(self, epoch: int) -> None:
        """Shuffles by ``(seed, epoch)``: call it before each epoch, or every epoch repeats."""
        self.epoch = epoch

    def plan(self) -> EpochPlan:
        """This rank's steps of the current epoch, from the position a resume left in it."""
        pos, engine = self.trainer.position, self.trainer.engine
        start = pos.in_epoch if self.epoch == pos.epoch else 0
        return self.sampler.steps(self.epoch, engine.rank, engine.size, start)

    def __iter__(self) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        plan = self.plan()
        self.trainer.begin_epoch(self.epoch, plan, len(self.x))
        for step in plan:
            for micro in step.micro:
                yield tf.convert_to_tensor(self.x[micro]), tf.convert_to_tensor(self.y[micro])

    def __len__(self) -> int:
        return len(self.plan()) * self.sampler.accumulation


class TapeTrainer(OwnLoop):
    """hvdtrain under a user's own ``tf.GradientTape`` loop; every rank makes one (see the module
    docstring).

    ``config`` and ``overrides`` are ``hvdtrain train``'s (None: the defaults, with
    ``framework=tensorflow``); what applies is :class:`hvdtrain.torch.api.Trainer`'s: ``seed``,
    ``data`` (batch size per rank, shuffle), ``train`` (``backward_passes_per_step``,
    ``precision``, ``epochs``, ``max_steps``), ``optim`` (when :meth:`setup` builds the
    optimizer; ``clip_norm`` and L2 decay always), ``comm`` (the exchange), ``checkpoint`` and
    ``log``. Starts Horovod and seeds Keras with ``seed + rank``, as the trainer does: build the
    model after it.
    """

    def __init__(self, config: str | Path | None = None, overrides: Sequence[str] = ()) -> None:
        first = ["framework=tensorflow"] if config is None else []
        self.cfg = cfg = load_config(config, [*first, *overrides])
        refuse_unsupported(cfg)
        self.engine = TapeEngine(cfg)
        self.run_dir = RunDir(cfg.run_dir)
        self.checkpoints = CheckpointManager(cfg.checkpoint, self.run_dir.checkpoints)
        self.position = Position()
        self.resumed = False
        self.objects: dict[str, Any] = {}
        self.micro = 0  # micro-batches of the current global batch so far
        self.accumulated: list[tf.Tensor] = []
        self.schedule = False
        self.plan: EpochPlan | None = None
        self.cursor = 0
        self.num_samples = 0
        self.batches: GlobalBatches | None = None
        self.logger: MetricsLogger | None = None
        self.saved_step = -1
        self.stop = StopRequest().__enter__()  # until close(): the loop is the user's

    # -- set-up -------------------------------------------------------------------------------

    def setup(self, model: keras.Model, optimizer: keras.optimizers.Optimizer | None = None,
              **objects: Any) -> tuple[keras.Model, keras.optimizers.Optimizer]:
        """Takes the built ``model`` and ``optimizer`` (None: the config's ``optim``, whose
        schedule the trainer then sets every step) in the configured exchange, resumes as
        ``checkpoint.resume`` says, and broadcasts rank 0's state. ``objects``: anything with
        ``state_dict`` and ``load_state_dict``, saved and resumed by name. Returns the model and
        the optimizer the update steps (a loss-scale one under fp16)."""
        self.schedule = optimizer is None
        self.engine.attach(self.cfg, model, optimizer or make_optimizer(self.cfg.optim))
        self.objects = dict(objects)
        start = start_on_rank0(self.cfg, self.run_dir, self.engine) if self.rank == 0 \
            else Start()
        self._share(start)
        return model, self.engine.optimizer

    def dataset(self, x: Any, y: Any) -> GlobalBatches:
        """This rank's micro-batches of ``(x, y)`` (arrays of one length) by hvdtrain's global
        batch sampler: ``data.batch_size`` samples per rank and micro-batch."""
        self.batches = GlobalBatches(self, x, y)
        self.num_samples = len(self.batches.x)
        return self.batches

    @property
    def total_steps(self) -> int:
        """The step at which ``train.epochs`` (capped by ``train.max_steps``) end."""
        if self.batches is None:
            return self.cfg.train.max_steps
        return total_steps(self.cfg.train, self.batches.sampler, self.size,
                           dataclasses.replace(self.position))

    def lr(self) -> float:
        """The config's learning rate for the coming step (warm-up, scaling, schedule)."""
        world = World.of(self.cfg, self.size)
        return lr_at(self.position.step, self.total_steps, self.cfg.optim, self.size,
                     base_lr=world.lr)

    # -- the step -----------------------------------------------------------------------------

    def begin_epoch(self, epoch: int, plan: EpochPlan, num_samples: int) -> None:
        """Called by :class:`GlobalBatches` as an epoch's iteration starts."""
        if epoch != self.position.epoch:
            self.position.epoch, self.position.in_epoch = epoch, 0
        self.plan, self.cursor, self.micro, self.accumulated = plan, 0, 0, []

    def apply_gradients(self, tape: tf.GradientTape, loss: tf.Tensor) -> bool:
        """Takes ``loss``'s gradients (the mean over this micro-batch's samples) from ``tape``,
        weighted so that the exchanged gradient is the mean over the global batch and scaled by
        the loss scale; at a global batch's last micro-batch exchanges them and updates (then a
        checkpoint or stop may follow). Returns whether the step ran."""
        if not hasattr(self.engine, "kernels"):
            raise HvdtrainError("trainer.apply_gradients() before trainer.setup(model)")
        variables = [v.value for v in self.engine.model.trainable_variables]
        step, accumulation = self._current(), self.engine.accumulation
        count = len(step.micro[self.micro]) if step is not None else 1
        if count == 0:  # nothing here: zero gradients still join the exchange
            grads = [tf.zeros_like(v) for v in variables]
        else:
            weight = 1.0 / accumulation if step is None else self.size * count / step.global_count
            scaled = self.engine.precision.scale(self.engine.optimizer, tf.constant(weight))
            grads = [tf.convert_to_tensor(g) for g in tape.gradient(
                loss, variables, output_gradients=tf.cast(scaled, loss.dtype),
                unconnected_gradients=tf.UnconnectedGradients.ZERO)]
        self.accumulated = grads if not self.accumulated else \
            [a + g for a, g in zip(self.accumulated, grads, strict=True)]
        self.micro += 1
        if self.micro < accumulation:
            return False
        self._update()
        return True

    def _update(self) -> None:
        kernels = cast(TapeKernels, self.engine.kernels)
        if self.schedule:
            kernels.set_lr(self.lr())
        kernels.take(self.accumulated)
        self.engine.stats = exchange_and_update(kernels, self.engine.exchange)
        self.accumulated, self.micro = [], 0
        self._advance()
        self._after_step()

    def _advance(self) -> None:
        step, pos = self._current(), self.position
        pos.step += 1
        if step is None:
            return
        self.cursor += 1
        pos.in_epoch += step.global_count
        pos.samples += step.global_count
        if pos.in_epoch >= self.num_samples:
            pos.epoch, pos.in_epoch = pos.epoch + 1, 0

    def _after_step(self) -> None:
        """Periodic checkpoints, and stop requests agreed at each log interval (then a
        checkpoint and exit 75), as the trainer does."""
        step = self.position.step
        if self.checkpoints.due(step) and self.saved_step != step:
            self.save()
        if step % self.cfg.log.every_steps == 0 or step == self.total_steps:
            agreed = self.engine.collectives.allreduce_sums({"stop": float(self.stop())})
            if agreed["stop"] > 0:
                self._stop()

    # -- logging and checkpoints --------------------------------------------------------------

    def parameters(self) -> dict[str, np.ndarray]:
        """The model's trainable variables as NumPy arrays, by position and name (for checks)."""
        return self.engine.parameters()

    def close(self) -> None:
        """Ends the run: the sinks closed, the last checkpoint on disk, the exchange ended and
        the stop-signal handlers restored. Every rank calls it once, after the loop."""
        try:
            if self.logger is not None:
                self.logger.close()
                self.logger = None
        finally:
            self.checkpoints.wait()
            if hasattr(self.engine, "exchange"):
                self.engine.finish()
            self.stop.__exit__(None, None, None)


def refuse_unsupported(cfg: Config) -> None:
    """One-line refusals of what :class:`TapeTrainer` does not do (yet)."""
    if cfg.framework != "tensorflow":
        raise HvdtrainError(f"framework={cfg.framework!r}: TapeTrainer trains Keras models; set "
                            "framework=tensorflow")
    if cfg.elastic.enabled:
        raise HvdtrainError("elastic.enabled=true: TapeTrainer has no elastic mode yet; use "
                            "`hvdtrain train` for elastic runs")
    if cfg.pipeline.stages > 1 or dedicated(cfg) or cfg.shard.stage:
        raise HvdtrainError("pipeline.stages>1, shard.stage and ps.placement=dedicated need "
                            "`hvdtrain train`: TapeTrainer wraps one whole model per rank")


__all__ = ["GlobalBatches", "TapeEngine", "TapeTrainer"]
