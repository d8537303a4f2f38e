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

    @trainer.function                                # instead of @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))   # the micro-batch's mean
        trainer.apply_gradients(tape, loss)
        return loss

    for epoch in trainer.epochs():
        batches.set_epoch(epoch)
        for xb, yb in batches:
            train_step(xb, yb)
        trainer.log({"loss": ...})
    trainer.close()

:meth:`TapeTrainer.function` traces the user's step with the gradients' weighting, the
exchange (where it can be traced: the dense one) and the update into one ``tf.function``, as a
hand-written ``hvd.DistributedGradientTape`` step is; the position, checkpoints and stop checks
follow in Python after each call. Without it, the same loop runs eagerly.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
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

    def traced_update(self, grads: list[tf.Tensor]) -> None:
        """Inside a traced step (:meth:`TapeTrainer.function`): the fusable exchange's average of
        ``grads`` and the trainer's update, traced into the caller's function."""
        self._apply(self.exchange.traced_mean(grads))


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
        # The traced form (:meth:`function`): the micro-batch's weight, read by the traced step;
        # gradient buffers where traced micro-batches accumulate; the kind of step being traced.
        self.weight: tf.Variable | None = None
        self.weight_value = float("nan")
        self.buffers: list[tf.Variable] = []
        self.tracing: str | None = None
        self.traced_calls = 0
        self.schedule = False
        self.plan: EpochPlan | None = None
        self.cursor = 0
        self.num_samples = 0
        self.batches: GlobalBatches | None = None
        self.logger: MetricsLogger | None = None
        self.saved_step = -1
        self._total: tuple[GlobalBatches, Position, int, int] | None = None  # total_steps's
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
        # Read every step: computed once per world size, dataset and position object. A step
        # moves the position by one global batch, which leaves the end where it was; a resume
        # replaces the position, and an epoch skipped by the loop resets the cache.
        cached = self._total
        if cached is None or cached[0] is not self.batches or cached[1] is not self.position \
                or cached[2] != self.size:
            total = total_steps(self.cfg.train, self.batches.sampler, self.size,
                                dataclasses.replace(self.position))
            self._total = cached = (self.batches, self.position, self.size, total)
        return cached[3]

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
            self._total = None  # the loop moved the position itself: the end may move
        self.plan, self.cursor, self.micro, self.accumulated = plan, 0, 0, []

    def apply_gradients(self, tape: tf.GradientTape, loss: tf.Tensor) -> bool:
        """Takes ``loss``'s gradients (the mean over this micro-batch's samples) from ``tape``,
        weighted so that the exchanged gradient is the mean over the global batch and scaled by
        the loss scale; at a global batch's last micro-batch exchanges them and updates (then a
        checkpoint or stop may follow). Returns whether the step ran. Inside a step decorated
        with :meth:`function` the same, traced into it."""
        if not hasattr(self.engine, "kernels"):
            raise HvdtrainError("trainer.apply_gradients() before trainer.setup(model)")
        if tf.inside_function():
            return self._traced_gradients(tape, loss)
        variables = [v.value for v in self.engine.model.trainable_variables]
        weight = self._micro_weight()
        if weight == 0:  # nothing here: zero gradients still join the exchange
            grads = [tf.zeros_like(v) for v in variables]
        else:
            scaled = self.engine.precision.scale(self.engine.optimizer, tf.constant(weight))
            grads = [tf.convert_to_tensor(g) for g in tape.gradient(
                loss, variables, output_gradients=tf.cast(scaled, loss.dtype),
                unconnected_gradients=tf.UnconnectedGradients.ZERO)]
        self.accumulated = grads if not self.accumulated else \
            [a + g for a, g in zip(self.accumulated, grads, strict=True)]
        self.micro += 1
        if self.micro < self.engine.accumulation:
            return False
        self._update()
        return True

    def _micro_weight(self) -> float:
        """The current micro-batch's loss weight: this rank's share of the global batch times
        the ranks (0 for an empty micro-batch); equal shares outside the trainer's batches."""
        step = self._current()
        if step is None:
            return 1.0 / self.engine.accumulation
        count = len(step.micro[self.micro])
        return self.size * count / step.global_count if count else 0.0

    # -- the traced form ----------------------------------------------------------------------

    def function(self, fn: Callable[..., Any] | None = None, **options: Any) -> Any:
        """Decorates the loop's step function (``@trainer.function`` instead of
        ``@tf.function``; ``options`` go to ``tf.function``): one call runs one micro-batch, and
        its ``trainer.apply_gradients(tape, loss)`` is traced with the step: the weighting, the
        accumulation and, where the exchange can be traced (the dense one), the allreduce and
        the update, as a hand-written ``hvd.DistributedGradientTape`` step runs them. Other
        exchanges run eagerly after the call. The position, checkpoints and stop checks follow
        each step in Python."""
        if fn is None:
            return lambda f: TracedStep(self, f, options)
        return TracedStep(self, fn, options)

    def _traced_gradients(self, tape: tf.GradientTape, loss: tf.Tensor) -> bool:
        """``apply_gradients`` while :class:`TracedStep` traces the user's step."""
        if self.tracing is None or self.weight is None:
            raise traced_error("trainer.apply_gradients() inside a tf.function: decorate the "
                               "step with @trainer.function instead of @tf.function")
        self.traced_calls += 1
        engine = self.engine
        variables = [v.value for v in engine.model.trainable_variables]
        scaled = engine.precision.scale(engine.optimizer, self.weight.read_value())
        grads = tape.gradient(loss, variables, output_gradients=tf.cast(scaled, loss.dtype),
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        # An empty micro-batch (weight 0) has a NaN loss: it adds zeros, as the eager form.
        present = self.weight > 0
        grads = [tf.where(present, tf.convert_to_tensor(g), tf.zeros_like(v))
                 for g, v in zip(grads, variables, strict=True)]
        if self.tracing != "fused":
            for buffer, grad in zip(self.buffers, grads, strict=True):
                buffer.assign_add(grad)
            return self.tracing == "last"
        if self.buffers:
            grads = [g + b for g, b in zip(grads, self.buffers, strict=True)]
            for buffer in self.buffers:
                buffer.assign(tf.zeros_like(buffer))
        cast(TapeKernels, engine.kernels).traced_update(grads)
        return True

    def trace(self, mode: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """Runs ``fn`` as ``tf.function`` traces it for ``mode`` (``accumulate``: a micro-batch
        before the last; ``last``: the last, before an eager exchange; ``fused``: the last with
        the exchange and update)."""
        self.tracing, self.traced_calls = mode, 0
        try:
            result = fn(*args, **kwargs)
        finally:
            self.tracing = None
        if self.traced_calls != 1:
            raise traced_error(f"a @trainer.function step called trainer.apply_gradients() "
                               f"{self.traced_calls} times: call it once per step")
        return result

    def before_traced(self) -> str:
        """Before a traced micro-batch: its weight, and which trace of the step runs it."""
        engine = self.engine
        if not hasattr(engine, "kernels"):
            raise HvdtrainError("a @trainer.function step before trainer.setup(model)")
        if self.weight is None:
            self.weight = tf.Variable(1.0, trainable=False, name="hvdtrain_weight")
        fused = engine.exchange.fusable
        if not self.buffers and (engine.accumulation > 1 or not fused):
            self.buffers = [tf.Variable(tf.zeros_like(v.value), trainable=False)
                            for v in engine.model.trainable_variables]
        weight = self._micro_weight()
        if weight != self.weight_value:  # one assignment where it changes (a short step)
            self.weight.assign(weight)
            self.weight_value = weight
        if self.micro < engine.accumulation - 1:
            return "accumulate"
        if not fused:
            return "last"
        if self.schedule:
            cast(TapeKernels, engine.kernels).set_lr(self.lr())
        return "fused"

    def after_traced(self, mode: str) -> None:
        """After a traced micro-batch: at a step's end the eager exchange (``last``) or the
        fused one's bookkeeping, then the position, checkpoints and stop checks."""
        self.micro += 1
        if mode == "accumulate":
            return
        if mode == "last":
            self.accumulated = [tf.identity(b) for b in self.buffers]
            for buffer in self.buffers:
                buffer.assign(tf.zeros_like(buffer))
            self._update()
            return
        exchange = self.engine.exchange
        exchange.note_fused(float("nan"))  # counted; its wait is not timed inside the step
        self.engine.stats = dict(exchange.stats)
        self.accumulated, self.micro = [], 0
        self._advance()
        self._after_step()

    def _update(self) -> None:
        kernels = cast(TapeKernels, self.engine.kernels)
        if self.schedule:
            kernels.set_lr(self.lr())
        kernels.take(self.accumulated)
        self.engine.exchange.run_length(self.total_steps)  # comm.dense_fraction's steps
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


def traced_error(message: str) -> HvdtrainError:
    """An error raised while ``tf.function`` traces, kept one line: AutoGraph would rewrite its
    message into a trace of the user's code unless it carries ``ag_pass_through``."""
    error = HvdtrainError(message)
    error.ag_pass_through = True  # type: ignore[attr-defined]
    return error


class TracedStep:
    """A loop's step function as :meth:`TapeTrainer.function` decorates it: one
    ``tf.function`` per kind of micro-batch (``accumulate``, ``last``, ``fused``), each traced
    on its first call; the trainer's bookkeeping around each call."""

    def __init__(self, trainer: TapeTrainer, fn: Callable[..., Any],
                 options: dict[str, Any]) -> None:
        self.trainer, self.fn = trainer, fn
        # Horovod's XLA ops are not built; one trace covers full and short batches.
        self.options = {"jit_compile": False, "reduce_retracing": True, **options}
        self.traced: dict[str, Any] = {}
        functools.update_wrapper(self, fn)

    def _function(self, mode: str) -> Any:
        if mode not in self.traced:
            def step(*args: Any, **kwargs: Any) -> Any:
                return self.trainer.trace(mode, self.fn, args, kwargs)
            self.traced[mode] = tf.function(step, **self.options)
        return self.traced[mode]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs one micro-batch: the user's step, traced; returns what it returns."""
        mode = self.trainer.before_traced()
        result = self._function(mode)(*args, **kwargs)
        self.trainer.after_traced(mode)
        return result


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


__all__ = ["GlobalBatches", "TapeEngine", "TapeTrainer", "TracedStep"]
