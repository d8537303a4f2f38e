"""Pipeline stages for TensorFlow (Keras 3): each rank builds and trains one stage of the model.

Nothing like ``torch.distributed.pipelining`` exists for Keras, so the pieces are hvdtrain's:

- **Layers.** The adapter's layer factories (:meth:`hvdtrain.adapters.ModelAdapter.layers`) are cut
  by ``pipeline.split`` (:mod:`hvdtrain.pipeline.split`); a rank builds only its own stage's
  layers, so the other stages' weights never exist on it (:func:`build_stage`), and its initial
  weights are those of the whole model: they do not depend on the split.
- **Messages.** Activations and their gradients travel between neighbouring stages of a pipeline
  copy by Horovod's ``alltoall`` in the pair's two-rank process set (:class:`Link`): the sender's
  splits are ``[0, n]``, the receiver's ``[0, 0]``, so the receiver learns the row count from the
  message. Each stage learns its input's shape and dtype once, from the stage before it, when the
  model is built.
- **Schedule.** The action lists of :mod:`hvdtrain.pipeline.actions` (``gpipe``, ``1f1b``), run
  by :class:`hvdtrain.pipeline.stage_step.StageRunner` inside :func:`hvdtrain.step.train_step`.
  A forward pass runs under a ``tf.GradientTape`` of its own, kept with its input until the
  backward pass, which takes the gradient of the output with the received output gradient
  (``output_gradients``) with respect to the stage's variables and its input.
- **Data parallelism.** Each stage's gradients are averaged over that stage's copies by the run's
  exchange (dense or compressing) in the stage's Horovod process set, once per step, with the loss
  weighted as :mod:`hvdtrain.step` weights it: every copy's exact share of the step's samples.
  With ``shard.stage`` 1-3 the copies shard the stage (:mod:`hvdtrain.tensorflow.stages`; at
  stage 2 each micro-batch's gradient is reduce-scattered as its backward pass ends; at stage 3
  the stage's parameters too, gathered per layer in each pass).
- **Checkpoints.** In parts by global layer index, which do not depend on the split, with the
  exchange's state by variable name (:mod:`hvdtrain.tensorflow.stage_state`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from hvdtrain.compression import make_plan
from hvdtrain.compression.exchange import Exchange
from hvdtrain.compression.rules import OptimizerSettings
from hvdtrain.config import Config
from hvdtrain.data import tree
from hvdtrain.data.contracts import ArraySpec, Dataset, DatasetSpec
from hvdtrain.data.loading import loader_workers
from hvdtrain.data.sampler import StepIndices
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import Exchanged, ExchangeRequest, build_exchange
from hvdtrain.layout import Layout
from hvdtrain.pipeline import stage_step
from hvdtrain.pipeline.actions import ORDERED
from hvdtrain.pipeline.schedules import microbatch_count
from hvdtrain.pipeline.split import layer_names, stage_bounds
from hvdtrain.pipeline.stage_step import StageRunner
from hvdtrain.step import add_batch_sums, train_step
from hvdtrain.tensorflow import compression, parts
from hvdtrain.tensorflow.data import TensorFlowLoader
from hvdtrain.tensorflow.engine import TensorFlowEngine, l2_decay, make_optimizer, optimizer_settings
from hvdtrain.tensorflow.exchange import applies_update, stepping_optimizer
from hvdtrain.tensorflow.shard import FlatShard
from hvdtrain.tensorflow.shard3 import free_fusion_buffer
from hvdtrain.tensorflow.shard_grads import UnitShard
from hvdtrain.tensorflow.stage_state import StageState
from hvdtrain.tensorflow.stages import (
    ScatteredPasses,
    ShardedUpdate,
    ShardSlots,
    StageShardedExchange,
    StageStage3Exchange,
    StageUnitExchange,
    StageUnits,
    slice_creator,
    stage_slices,
)
from hvdtrain.tensorflow.step import TensorFlowKernels

# messages ---------------------------------------------------------------------------------------

class Link:
    """Messages with one neighbouring stage: Horovod's ``alltoall`` in the pair's process set.

    A message is a rendezvous: the call returns when both ranks have made it. ``tag`` names the
    link in Horovod's op names, which both ends must give alike.
    """

    def __init__(self, process_set: Any, upstream: bool, shape: Sequence[int], dtype: tf.DType,
                 tag: str) -> None:
        self.process_set, self.tag = process_set, tag
        self.shape, self.dtype = tuple(shape), dtype
        # The upstream rank is the lower one: rank 0 of the pair's process set.
        self._to_peer = (lambda n: [0, n]) if upstream else (lambda n: [n, 0])
        self._empty = tf.zeros([0, *self.shape], dtype)
        self._nothing = tf.constant([0, 0], tf.int32)

    def send(self, tensor: tf.Tensor, what: str) -> None:
        """Sends ``tensor`` (rows first, this link's sample shape) to the neighbour."""
        splits = tf.constant(self._to_peer(int(tensor.shape[0])), tf.int32)
        hvd.alltoall(tensor, splits=splits, name=f"hvdtrain.pipe.{self.tag}.{what}",
                     process_set=self.process_set)

    def recv(self, rows: int, what: str) -> tf.Tensor:
        """The neighbour's tensor of ``rows`` rows; raises when it sent another count."""
        got, _ = hvd.alltoall(self._empty, splits=self._nothing,
                              name=f"hvdtrain.pipe.{self.tag}.{what}", process_set=self.process_set)
        if int(got.shape[0]) != rows:
            raise HvdtrainError(f"pipeline link {self.tag}: received {int(got.shape[0])} rows for "
                                f"{what}, expected {rows}: the stages disagree on the step")
        return got


def describe(shape: Sequence[Any], dtype: Any) -> tuple[tuple[int, ...], str]:
    """A stage boundary's sample shape and dtype, in the form stages hand each other."""
    if any(d is None for d in shape):
        raise HvdtrainError(f"a pipeline stage's output must have a fixed sample shape, not "
                            f"{tuple(shape)}: every micro-batch travels with the same shape")
    return tuple(int(d) for d in shape), tf.as_dtype(dtype).name


# the stage's model ------------------------------------------------------------------------------

def make_layers(factories: Sequence[Callable[[], Any]], seed: int) -> list[Any]:
    """Every layer, made in order under the run's seed (rank 0's, whose weights a whole model's
    ranks start from), none built yet. A Keras layer draws its initializers' seeds when it is made
    and its weights only when it is built, so building a stage's layers alone gives them the whole
    model's initial values whatever the split."""
    keras.utils.set_random_seed(seed)
    layers = [factory() for factory in factories]
    for k, layer in enumerate(layers):
        if not callable(layer):
            raise HvdtrainError(f"pipeline layer {k}: its factory returned {type(layer).__name__}, "
                                "not a Keras layer")
    return layers


def measure(layers: Sequence[Any], shape: Sequence[int], dtype: str
            ) -> tuple[list[int], list[tuple[tuple[int, ...], str]]]:
    """Each layer's parameter count and input (sample shape, dtype), by building the layers one
    after another on symbolic inputs (``pipeline.split: auto``). The caller keeps its own
    stage's; the others' weights go with them."""
    x = keras.Input(shape=tuple(shape), dtype=dtype)
    costs, inputs = [], []
    for layer in layers:
        inputs.append(describe(x.shape[1:], x.dtype))
        x = layer(x)
        costs.append(int(layer.count_params()))
    return costs, inputs


def stage_model(layers: Sequence[Any], shape: Sequence[int], dtype: str) -> keras.Model:
    """The ``keras.Model`` of a stage's layers, in order, from inputs of this sample shape."""
    inputs = keras.Input(shape=tuple(shape), dtype=dtype)
    x = inputs
    for layer in layers:
        x = layer(x)
    return keras.Model(inputs, x)


# the kernels ------------------------------------------------------------------------------------

class TensorFlowStageKernels(TensorFlowKernels, stage_step.StageKernels):
    """One stage's forward and backward passes, messages, gradient sums and update.

    ``prev`` and ``next`` are the links to the neighbouring stages (None at the ends). The last
    stage scores its output with the adapter's ``output_loss``; ``metric_keys`` are the metric
    names it reports, which every stage reports (as zeros) so the cross-rank sums agree.
    """

    def __init__(self, *args: Any, stage: int, stages: int, prev: Link | None, next_: Link | None,
                 metric_keys: Sequence[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stage, self.stages = stage, stages
        self.first, self.last = stage == 0, stage == stages - 1
        self.prev, self.next = prev, next_
        self.metric_keys = list(metric_keys)
        self.variables = [v.value for v in self.model.trainable_variables]
        self._inputs: dict[int, Any] = {}
        self._outputs: dict[int, tf.Tensor] = {}
        self._tapes: dict[int, tf.GradientTape] = {}
        self._out_grads: dict[int, tf.Tensor] = {}
        self._in_grads: dict[int, tf.Tensor] = {}
        self._sums: list[tf.Tensor] = []

    def _compile(self) -> None:
        grads = [tf.TensorSpec(v.shape, tf.float32) for v in self.model.trainable_variables]
        self.apply = tf.function(self._apply, input_signature=[grads], jit_compile=False)
        self.precision.attach(self.optimizer, self.apply, [tuple(g.shape) for g in grads])
        self._forward_fn = tf.function(self._forward, jit_compile=False, reduce_retracing=True)
        self._score_fn = tf.function(self._score, jit_compile=False, reduce_retracing=True)

    def _forward(self, x: tf.Tensor) -> tf.Tensor:
        return self.model(x, training=True)

    def _score(self, out: tf.Tensor, y: Any, weight: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, dict]:
        loss_sum, metrics = self.adapter.output_loss(out, y, training=True)
        return loss_sum * weight, loss_sum, metrics

    # the kernels of hvdtrain.step and hvdtrain.pipeline.stage_step --------------------------------

    def batches(self, step: StepIndices) -> Iterator[Any]:
        if not (self.first or self.last):
            return iter([None] * len(step.micro))  # a middle stage reads no data
        # The copy's batch loads as one, as the sampler planned it (the loader prefetches the
        # plan's batches), and is cut into the micro-batches here.
        whole = dataclasses.replace(step, micro=[np.concatenate(step.micro)])
        x, y = next(self.data.batches(whole))
        bounds = np.cumsum([0, *(len(idx) for idx in step.micro)])
        return iter([tree.map_tree(lambda t, a=a, b=b: t[a:b], (x, y))
                     for a, b in itertools.pairwise(bounds)])

    def begin(self) -> None:
        self._sums = [tf.zeros_like(v) for v in self.variables]

    def zero_sums(self) -> dict[str, float]:
        return {"loss": 0.0, "count": 0.0, **{k: 0.0 for k in self.metric_keys}}

    def forward(self, i: int, batch: Any, weight: float) -> tuple[Any, dict[str, Any]] | None:
        x = batch[0] if self.first else self._inputs[i]
        with tf.GradientTape() as tape:
            if not self.first:
                tape.watch(x)
            out = self._forward_fn(x)
            if self.last:
                target, loss_sum, metrics = self._score_fn(out, batch[1], self._scale(weight))
                out = target
        self._inputs[i], self._outputs[i], self._tapes[i] = x, out, tape
        return (loss_sum, metrics) if self.last else None

    def backward_pass(self, i: int) -> None:
        tape, out, x = self._tapes.pop(i), self._outputs.pop(i), self._inputs.pop(i)
        sources = self.variables if self.first else [*self.variables, x]
        # Zeros, not None, for a variable the loss does not reach: every copy sends every tensor.
        grads = tape.gradient(out, sources, output_gradients=None if self.last
                              else self._out_grads.pop(i),
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        if not self.first:
            self._in_grads[i] = grads.pop()
        self._add(grads)

    def _add(self, grads: list[tf.Tensor]) -> None:
        """One micro-batch's gradients into the step's sums."""
        self._sums = [s + g for s, g in zip(self._sums, grads, strict=True)]

    def send_activation(self, i: int) -> None:
        assert self.next is not None
        self.next.send(self._outputs[i], f"act.{i}")

    def recv_activation(self, i: int, rows: int) -> None:
        assert self.prev is not None
        self._inputs[i] = self.prev.recv(rows, f"act.{i}")

    def send_gradient(self, i: int) -> None:
        assert self.prev is not None
        self.prev.send(self._in_grads.pop(i), f"grad.{i}")

    def recv_gradient(self, i: int, rows: int) -> None:
        assert self.next is not None
        self._out_grads[i] = self.next.recv(rows, f"grad.{i}")

    def gradients(self) -> list[tf.Tensor]:
        return list(self._sums)

    def fused_last(self, batch: Any, weight: float, exchange: Any) -> None:
        return None  # the exchange runs in the stage's process set, after the schedule

    # evaluation ---------------------------------------------------------------------------------

    def evaluate(self, batches: Iterable[np.ndarray]) -> dict[str, float]:
        """This copy's sums over the test batches: each batch's forward pass through the stages
        in turn (the first stage loads the inputs, the last the targets and scores)."""
        sums = self.zero_sums()
        indices = list(batches)
        loaded: Iterator[Any] = (self.data.eval_batches(indices) if self.first or self.last
                                 else iter([None] * len(indices)))
        for n, (idx, batch) in enumerate(zip(indices, loaded, strict=True)):
            if not len(idx):
                continue  # empty on every stage of this copy alike
            x = batch[0] if self.prev is None else self.prev.recv(len(idx), f"eval.{n}")
            out = self.model(x, training=False)
            if self.next is not None:
                self.next.send(out, f"eval.{n}")
            else:
                loss_sum, metrics = self.adapter.output_loss(out, batch[1], training=False)
                add_batch_sums(sums, loss_sum, metrics, len(idx))
        return sums


class ShardedStageKernels(ShardedUpdate, TensorFlowStageKernels):
    """A sharded stage's kernels (``shard.stage=1``): the stage's passes and messages, the
    sharded update of :class:`hvdtrain.tensorflow.stages.ShardedUpdate`."""

    def __init__(self, *args: Any, shard: FlatShard | UnitShard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shard = shard

    def follow(self, exchange: Any, accumulation: int) -> None:
        self.sharded = exchange
        super().follow(exchange, accumulation)


class UnitShardedStageKernels(ScatteredPasses, ShardedStageKernels):
    """A stage's kernels at ``shard.stage=2``: each micro-batch's gradient reduce-scattered into
    the copy's shard as its backward pass ends (:class:`hvdtrain.tensorflow.stages.
    ScatteredPasses`), then :class:`ShardedStageKernels`' update."""


class Stage3StageKernels(ShardedStageKernels):
    """A stage's kernels at ``shard.stage=3``: the passes take the gradient with respect to the
    shard variable, which the layers' calls (:class:`hvdtrain.tensorflow.stages.StageUnits`)
    gather from and reduce-scatter into; the step sums those averaged shards and steps the shard,
    with nothing gathered after it. Every micro-batch runs on every copy (``runs_empty``)."""

    runs_empty = True

    def __init__(self, *args: Any, units: StageUnits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.units = units
        self.variables = [self.shard.var.value]  # what the passes differentiate

    def _compile(self) -> None:
        super()._compile()
        # One trace for every micro-batch size (an empty one too): the copies' gathers, named
        # after the traced graph's tensors, then pair up whatever rows each copy has.
        spec = tf.TensorSpec([None, *self.model.input.shape[1:]], self.model.input.dtype)
        self._forward_fn = tf.function(self._forward, input_signature=[spec], jit_compile=False)

    def _update(self, grads: list[tf.Tensor]) -> None:
        self._apply_shard_fn(grads)  # the layers gather the new slices in the next passes


# the exchange within a stage's copies -----------------------------------------------------------

class StageExchange(compression.CompressingExchange):
    """The run's exchange (any ``comm.compression``) among one stage's copies: Horovod's
    collectives in the stage's process set. ``rank`` and ``size`` are the copy's place among
    them and their number; ``root`` is the global rank of copy 0 (broadcasts come from it)."""

    fusable = False  # run eagerly after the schedule, not traced into a step function

    def __init__(self, plan: Any, rank: int, size: int, process_set: Any, root: int,
                 opt: OptimizerSettings | None = None,
                 weights: Callable[[], Sequence[tf.Tensor]] | None = None) -> None:
        self.process_set, self.root = process_set, root
        super().__init__(plan, rank, size, opt, weights)

    def _build(self) -> None:
        self._collect_fn = compression._function(
            functools.partial(compression._collective, process_set=self.process_set))
        Exchange._build(self)

    def _allgather_rows(self, array: np.ndarray, name: str) -> np.ndarray:
        return hvd.allgather(tf.constant(array[None]), name=name,
                             process_set=self.process_set).numpy()

    def _broadcast(self, array: np.ndarray, root_rank: int, name: str) -> np.ndarray:
        return hvd.broadcast(tf.constant(array), self.root, name=name,
                             process_set=self.process_set).numpy()

    def any_rank(self, flag: bool) -> bool:
        total = hvd.allreduce(tf.constant([float(flag)]), op=hvd.Sum, name="hvdtrain.stage.any",
                              process_set=self.process_set)
        return float(total[0]) > 0


def make_stage_exchange(cfg: Any, request: ExchangeRequest) -> Exchanged:
    """The exchange over one stage's gradients among its copies and the optimizer the step
    drives with it, built by the ``tensorflow.stage`` factory the strategies' registry names for
    ``cfg`` (:func:`hvdtrain.exchange.build_exchange`), as :func:`~hvdtrain.tensorflow.exchange.
    make_exchange` builds a whole model's."""
    return build_exchange(cfg, request, stage=True)


def stage_exchange(r: ExchangeRequest) -> Exchanged:
    """``dense`` or ``compressing`` among a stage's copies: one :class:`StageExchange` runs
    either plan (with the update rule of ``r.settings`` where one applies). ``r.places``: each
    gradient's place among the whole model's trainable variables, which seeds its random draws
    (random-k's indices, qsgd's noise, PowerSGD's first ``Q``), so that a stage draws what the
    whole model's exchange draws."""
    variables = list(r.params)
    plan = make_plan(r.comm, r.seed, [v.shape for v in variables], r.places,
                     compression.Kernels.out_last)
    exchange = StageExchange(plan, r.rank, r.size, r.process_set, r.root, r.settings,
                             lambda: [v.value for v in variables])
    return exchange, stepping_optimizer(exchange, r.optimizer)


def check_schedule(schedule: str) -> None:
    """Raises a one-line error for a schedule the TensorFlow stages do not run."""
    if schedule not in ORDERED:
        raise HvdtrainError(f"pipeline.schedule={schedule!r}: the TensorFlow engine runs "
                            f"{' and '.join(ORDERED)}")


# the engine -------------------------------------------------------------------------------------

_SETS: dict[tuple[int, ...], Any] = {}
"""The process sets this process added to Horovod, by their ranks (Horovod refuses a second)."""


def register_process_sets(layout: Layout) -> tuple[dict[int, Any], dict[tuple[int, int], Any]]:
    """Adds the stage groups and the two-rank links of every copy to Horovod (a collective, in
    the same order on every rank): ``(stage sets by stage, link sets by (copy, upstream
    stage))``. A group of every rank is Horovod's global set; a stage group of one copy is a set
    of its one rank, so that its exchange and broadcasts stay within it."""
    everyone = list(range(layout.size))

    def add(ranks: list[int]) -> Any:
        if ranks == everyone:
            return hvd.global_process_set
        if tuple(ranks) not in _SETS:  # a second training in this process finds them added
            _SETS[tuple(ranks)] = hvd.add_process_set(ranks)
        return _SETS[tuple(ranks)]

    stages = {s: add(layout.stage_ranks(s)) for s in range(layout.stages)}
    links = {(c, s): add([layout.rank_of(s, c), layout.rank_of(s + 1, c)])
             for c in range(layout.copies) for s in range(layout.stages - 1)}
    return stages, links


class PipelineEngine(StageState, TensorFlowEngine):
    """The TensorFlow engine for ``pipeline.stages`` > 1: this rank holds one stage of one
    pipeline copy (:class:`hvdtrain.layout.Layout`); see the module docstring.

    ``size`` stays the world's (the loop and the writers count ranks); ``copies`` is the number
    of pipeline copies, the data-parallel width that the sampler and the exchange use."""

    def __init__(self, cfg: Config, dataset: Dataset) -> None:
        check_schedule(cfg.pipeline.schedule)
        if cfg.shard.stage >= 3:  # before Horovod starts, as the pipeline-free stage 3
            free_fusion_buffer()
        self._restored: dict[str, Any] | None = None  # rank 0's: where each rank reads its share
        self._start(cfg)  # with dynamic process sets: the stage groups and links are added now
        # self.layout (the job's layout of ranks) was made as Horovod started.
        self.stage, self.copy = self.layout.stage_of(self.rank), self.layout.copy_of(self.rank)
        self.copies, self.root = self.layout.copies, self.layout.rank_of(self.stage, 0)
        stage_sets, links = register_process_sets(self.layout)
        self.stage_set = stage_sets[self.stage]
        self.spec = dataset.spec()
        # shard.stage=3: each trainable variable cut to the copy's slice as it is made.
        creator = slice_creator(self.copy, self.copies) if cfg.shard.stage >= 3 else None
        with self.precision.policy(), (tf.variable_creator_scope(creator) if creator
                                       else contextlib.nullcontext()):
            self.model, self.layers, self.first_layer = self._build_stage(cfg, links)
        slices = stage_slices(creator, self.model) if creator else None
        del creator  # the other stages' slices (split: auto builds every layer)
        keras.utils.set_random_seed(cfg.seed + self.rank)  # after the weights: dropout per rank
        self.data = TensorFlowLoader(dataset.train(), dataset.test(), seed=cfg.seed, rank=self.rank,
                                     workers=loader_workers(cfg.data.workers, self.local_size),
                                     prefetch=cfg.data.prefetch, spec=self.spec)
        pipe = cfg.pipeline
        self.microbatches = microbatch_count(pipe.stages, pipe.microbatches, pipe.virtual_stages)
        self.micro_size = cfg.data.batch_size // self.microbatches
        variables = self.model.trainable_variables
        self.trainable, self.all_trainable = self._trainable_names(variables)
        self.exchange, optimizer = make_stage_exchange(cfg, ExchangeRequest(
            cfg.comm, cfg.seed, self.copy, self.copies, variables,
            optimizer=make_optimizer(cfg.optim), settings=optimizer_settings(cfg.optim),
            model=self.model, accumulation=self.microbatches,
            layout=self.layout, places=[self.all_trainable.index(n) for n in self.trainable],
            process_set=self.stage_set, root=self.root, shard=cfg.shard))
        plain = applies_update(self.exchange)  # the exchange applies the optimizer's rule
        self.optimizer = self.precision.wrap(optimizer)
        # shard.stage 1-3 (tensorflow/stages.py): the optimizer steps the copy's shard.
        shard = (self.exchange.shard if isinstance(
            self.exchange, StageShardedExchange | StageUnitExchange | StageStage3Exchange)
            else None)
        self.units: StageUnits | None = None
        if isinstance(self.exchange, StageStage3Exchange):
            assert slices is not None
            self.units = StageUnits(self.model, self.exchange.shard, cfg.shard.prefetch,
                                    cfg.shard.reshard_after_forward, self.exchange.wire, slices)
        self.optimizer.build([shard.var] if shard else variables)
        self.slots = ShardSlots(shard, self.optimizer, self.trainable) if shard else None
        self.stats: dict[str, float] = {}
        self.accumulation = 1
        kernels: type[TensorFlowStageKernels] = TensorFlowStageKernels
        extra: dict[str, Any] = {}
        if isinstance(self.exchange, StageUnitExchange):
            kernels = UnitShardedStageKernels
            extra = {"shard": shard, "microbatches": self.microbatches}
        elif self.units is not None:
            kernels, extra = Stage3StageKernels, {"shard": shard, "units": self.units}
        elif shard is not None:
            kernels, extra = ShardedStageKernels, {"shard": shard}
        self.kernels = self.stage_kernels = kernels(
            self.model, self.optimizer, self.adapter, self.data, self.precision, self.spec,
            l2=l2_decay(cfg.optim, plain), stage=self.stage, stages=self.layout.stages,
            metric_keys=self._metric_keys(),
            prev=self._link(links, -1), next_=self._link(links, +1), **extra)
        self.kernels.follow(self.exchange, 1)
        self.runner = StageRunner(cfg.pipeline.schedule)

    @property
    def data_rank(self) -> int:
        return self.copy

    @property
    def data_size(self) -> int:
        return self.copies

    # building -------------------------------------------------------------------------------------

    def _build_stage(self, cfg: Config, links: dict[tuple[int, int], Any]
                     ) -> tuple[keras.Model, list[Any], int]:
        """This stage's model, its layers and the global index of its first. ``split: auto``
        measures every layer (built one at a time); a split by name or index builds this
        stage's alone and learns its input's shape from the stage before."""
        keras.utils.set_random_seed(cfg.seed)  # a Sequential's build() draws as rank 0's would
        factories = self.adapter.layers(self.spec)
        if factories is None:
            raise HvdtrainError(f"model {cfg.model.name!r} cannot be split into pipeline stages: "
                                "its adapter lists no layers (see hvdtrain.adapters.ModelAdapter"
                                ".layers)")
        made = make_layers(factories, cfg.seed)
        self.layer_count = len(made)
        stages, last = self.layout.stages, self.stage == self.layout.stages - 1
        inputs = None
        costs = [1] * len(made)
        if cfg.pipeline.split == "auto":
            costs, inputs = measure(made, *first_input(self.spec))
        bounds = stage_bounds(cfg.pipeline.split, costs, layer_names(factories), stages)
        lo, hi = bounds[self.stage], bounds[self.stage + 1]
        own = made[lo:hi]
        del made  # the other stages' layers
        if inputs is not None:
            shape, dtype = inputs[lo]
        elif self.stage == 0:
            shape, dtype = first_input(self.spec)
        else:
            shape, dtype = hvd.broadcast_object(
                None, root_rank=self.rank - 1, name="hvdtrain.pipe.shape",
                process_set=links[self.copy, self.stage - 1])
        model = stage_model(own, shape, dtype)
        if inputs is None and not last:
            hvd.broadcast_object(describe(model.output.shape[1:], model.output.dtype),
                                 root_rank=self.rank, name="hvdtrain.pipe.shape",
                                 process_set=links[self.copy, self.stage])
        return model, own, lo

    def _trainable_names(self, variables: Sequence[Any]) -> tuple[list[str], list[str]]:
        """The global names (:mod:`hvdtrain.tensorflow.parts`) of this stage's trainable
        variables, in its exchange's order, and of the whole model's, in the order of a whole
        model's exchange: every stage's in stage order (an allgather: no rank builds the other
        stages' layers)."""
        own = parts.trainable_names(self.layers, self.first_layer, variables)
        if own is None:
            raise HvdtrainError("a pipeline stage's trainable variables must be its layers'")
        every = self.collectives.allgather_object([own])
        return own, [name for s in range(self.layout.stages)
                     for name in every[self.layout.rank_of(s, 0)][0]]

    def _link(self, links: dict[tuple[int, int], Any], side: int) -> Link | None:
        """The link to the stage before (``side`` -1) or after (+1), None at the ends."""
        other = self.stage + side
        if not 0 <= other < self.layout.stages:
            return None
        upstream = min(self.stage, other)
        if side > 0:
            shape, dtype = describe(self.model.output.shape[1:], self.model.output.dtype)
        else:
            shape, dtype = describe(self.model.input.shape[1:], self.model.input.dtype)
        return Link(links[self.copy, upstream], side > 0, shape, tf.as_dtype(dtype),
                    f"{self.copy}.{upstream}")

    def _metric_keys(self) -> list[str]:
        """The last stage's metric names, which every rank reports (a collective)."""
        keys = None
        if self.stage == self.layout.stages - 1:
            out = tf.zeros([0, *self.model.output.shape[1:]], self.model.output.dtype)
            y = tree.map_tree(lambda s: tf.zeros([0, *s.shape], s.dtype), self.spec.targets)
            keys = sorted(self.adapter.output_loss(out, y, training=False)[1])
        return hvd.broadcast_object(keys, root_rank=self.layout.rank_of(self.layout.stages - 1, 0),
                                    name="hvdtrain.pipe.metrics")

    # the engine -----------------------------------------------------------------------------------

    def broadcast_state(self) -> None:
        """Copy 0's ranks read their share of a restored checkpoint (the parts that hold their
        layers, or their entries of one written whole), then every stage's copy 0 hands its state
        to the other copies (a broadcast in the stage's process set)."""
        restored = self.collectives.broadcast_object([self._restored])[0]
        self._restored = None
        if restored is not None:
            self._load_share(restored)
        hvd.broadcast_variables(self._state_variables(), root_rank=self.root,
                                process_set=self.stage_set)
        if self.units is not None:  # stage 3: each copy keeps its slices of the parameters
            self.units.start_from(restored is not None, self.root)
        if self.slots is not None:  # each copy's slice of the slots copy 0 restored
            self.slots.scatter(restored is not None, self.root, load=self.units is None)
        self._follow_world()
        self.exchange.broadcast(root_rank=self.root)

    def _state_variables(self) -> list[tf.Variable]:
        if self.slots is None:
            return super()._state_variables()
        # A shard's slots differ per copy (ShardSlots.scatter hands them out); at stage 3 so do
        # the parameters (StageUnits.start_from), and the model has no other variables.
        model = [] if self.units is not None else self.model.variables
        return [v.value for v in [*model, *self.slots.scalars()]]

    def _follow_world(self) -> None:
        self.kernels.follow(self.exchange, 1)  # a pipeline's world does not change (no elastic)

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        raise HvdtrainError("elastic mode does not work with pipeline stages")

    def micro_batches(self, step: StepIndices) -> StepIndices:
        """The copy's step (one batch of ``data.batch_size``) cut into the pipeline's
        micro-batches; those past the samples of a short last step are empty."""
        (idx,) = step.micro
        size = self.micro_size
        micro = [idx[i * size:(i + 1) * size] for i in range(self.microbatches)]
        return dataclasses.replace(step, micro=micro)

    def train_step(self, step: StepIndices, lr: float) -> dict[str, float]:
        result = train_step(self.kernels, self.exchange, self.micro_batches(step), lr,
                            self.copies, self.runner)
        self.stats = result.stats
        self.stats["pipe_wait_s"] = self.runner.wait_s
        self.stats["compute_s"] = max(self.stats["compute_s"] - self.runner.wait_s, 0.0)
        return result.sums

    def evaluate(self, batches: Iterable[np.ndarray]) -> dict[str, float]:
        with self.whole_stage():  # stage 3: no gathers per batch (copies' counts may differ)
            return self.stage_kernels.evaluate(batches)

    @contextlib.contextmanager
    def whole_stage(self) -> Iterator[None]:
        """At ``shard.stage=3``, the stage's variables whole for the block (a collective in the
        stage's set on entry), released after it; nothing otherwise."""
        if self.units is None:
            yield
            return
        self.units.materialise()
        try:
            yield
        finally:
            self.units.release()

    def pipeline_stages(self) -> list[int]:
        return [self.layout.stage_of(r) for r in range(self.size)]

    def placement(self) -> dict[str, str]:
        return {**super().placement(), "pipeline": self.layout.describe()}

    def parameters(self) -> dict[str, np.ndarray]:
        # By global layer index: the same names whatever the split.
        with self.whole_stage():
            found = {f"{k}.{j}.{v.name}": v.numpy().copy()
                     for k, layer in enumerate(self.layers, start=self.first_layer)
                     for j, v in enumerate(layer.trainable_variables)}
        if self.units is not None:
            # Every rank waits for the others' gathers: a rank that returns and exits while
            # another stage's copies still gather would shut Horovod down under them.
            self.collectives.allgather_object([None])
        return found


def first_input(spec: DatasetSpec) -> tuple[tuple[int, ...], str]:
    """The first stage's input: the dataset's one input array."""
    if not isinstance(spec.inputs, ArraySpec):
        raise HvdtrainError(f"pipeline stages need one input array; the dataset gives "
                            f"{tree.describe(spec.inputs)}")
    return describe(spec.inputs.shape, spec.inputs.dtype)

