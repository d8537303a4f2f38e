"""TensorFlow pipeline stages x sharded copies (``pipeline.stages`` > 1 with ``shard.stage`` 1,
2 or 3): each stage's data-parallel copies shard that stage's optimizer state (and at stage 2 its
gradients) in the stage's Horovod process set, as :func:`hvdtrain.torch.stages.stage_sharded`
does in PyTorch.

- **The update.** The stage's exchange (:func:`stage_sharded`) is the sharded update of
  :mod:`hvdtrain.tensorflow.shard` over the stage's trainable variables, its collectives in the
  stage's set (``rank``/``size``: the copy and the copies): the reduce-scatter averages each copy's
  shard of the stage's flat gradient, the run's Keras optimizer steps one variable holding the
  copy's shard of the stage's parameters (its slots cover 1/copies of the stage), and an
  all-gather in the set writes the shards back into the stage's layers (:class:`ShardedUpdate`).
- **Stage 2.** The stage's layers are units (:class:`~hvdtrain.tensorflow.shard_grads.UnitShard`
  in the stage's set); each micro-batch's gradient is reduce-scattered as its backward pass ends,
  and a copy with fewer non-empty micro-batches in a short last step reduce-scatters zeros for
  the rest, so the copies' collectives pair up (:class:`ScatteredPasses`); the update is stage
  1's.
- **Stage 3.** The stage's layers are built in slices (each trainable variable cut to the copy's
  slice as it is made, :func:`hvdtrain.tensorflow.shard3.build_in_slices`' creator) and wrapped
  in :class:`StageUnits`: each layer's call all-gathers its variables among the stage's copies
  for the forward pass, gathers them again in the backward pass and reduce-scatters their
  gradient into the copy's slices (:class:`hvdtrain.tensorflow.shard3.Stage3Units`, in the
  stage's set). The gradient of a micro-batch's pass with respect to the shard variable is
  therefore the copies' average of its slices already; the step sums them and the optimizer
  steps the shard; nothing is gathered after the step. Every copy runs every micro-batch (an
  empty one as a pass of no rows: ``StageKernels.runs_empty``), so the copies' gathers pair up.
  Evaluation, ``parameters()`` and a checkpoint gather the stage's variables whole for their
  duration (:meth:`StageUnits.materialise`), then release them.
- **Checkpoints.** A stage's part holds its optimizer state in the layout of a stage without
  sharding: each slot by the global name of its variable (``optimizer/<layer>.<j>/<slot>``,
  :mod:`hvdtrain.tensorflow.parts`), gathered whole in the stage's set before copy 0 writes it
  (:class:`ShardSlots`). A sharded pipeline therefore resumes from a pipeline checkpoint with or
  without sharding, of any split, and one without sharding from a sharded one. On resume copy 0
  reads the whole slots, and each copy takes its slice from copy 0's broadcast in the set. At
  stage 3 the part holds the stage's parameters whole too (gathered in the set while it is
  written), and on resume copy 0 hands each variable to the copies one at a time, each keeping
  its slice (:meth:`StageUnits.start_from`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import Exchanged, ExchangeRequest
from hvdtrain.ps.layout import chunk_elements
from hvdtrain.tensorflow.collectives import any_rank
from hvdtrain.tensorflow.shard import FlatShard, ShardedExchange
from hvdtrain.tensorflow.shard3 import Stage3Exchange, Stage3Units, _SliceCreator, check_model
from hvdtrain.tensorflow.shard_grads import UnitExchange, UnitShard, layer_units
from hvdtrain.tensorflow.step import _traced


class _AmongCopies:
    """What a sharded exchange among one stage's copies changes: the overflow vote of loss
    scaling runs in the stage's process set (``shard.process_set``), and it never resizes."""

    shard: Any

    def any_rank(self, flag: bool) -> bool:
        return any_rank(flag, self.shard.process_set)

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        raise HvdtrainError("pipeline stages do not resize (elastic mode is refused with them)")


class StageShardedExchange(_AmongCopies, ShardedExchange):
    """:class:`~hvdtrain.tensorflow.shard.ShardedExchange` among one stage's copies: the shard's
    collectives run in the stage's process set, and so does the overflow vote."""


class StageUnitExchange(_AmongCopies, UnitExchange):
    """``shard.stage=2`` among one stage's copies: the reduce-scatters run in the stage's
    backward passes (:class:`ScatteredPasses`), one for each of the step's micro-batches, so
    :meth:`run` hands on the averaged shard they summed and counts their seconds. ``wire_bytes``:
    the stage's whole gradient once per micro-batch and the float32 shard once."""

    fusable = False  # the schedule's passes run eagerly, the exchange after them

    def __init__(self, shard: UnitShard, compression: str, microbatches: int) -> None:
        super().__init__(shard, compression, microbatches)
        self.scatter_s = 0.0
        """Seconds in the step's reduce-scatters so far (:class:`ScatteredPasses` adds)."""

    def run(self, grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        self.note_fused(self.scatter_s)
        self.scatter_s = 0.0
        return list(grads)


class StageStage3Exchange(_AmongCopies, Stage3Exchange):
    """``shard.stage=3`` among one stage's copies: the reduce-scatters run inside the stage's
    backward passes (:class:`StageUnits`), so :meth:`run` hands on the averaged shard they
    summed. ``wire_bytes``: per micro-batch the stage's whole gradient once and the copy's
    float32 slices once per gather. ``comm_s`` is 0: the gathers and reduce-scatters run inside
    the passes, whose time counts as compute."""

    fusable = False  # the schedule's passes run eagerly, the exchange after them

    def run(self, grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        self.note_fused(0.0)
        return list(grads)


def stage_sharded(r: ExchangeRequest) -> Exchanged:
    """``sharded`` among a stage's copies (``r.process_set``; ``r.rank``, ``r.size``: this copy
    and the copies). ``shard.stage=1``: the reduce-scatter of the step's summed gradient, the
    shard's update and all-gather, in rounds of ``shard.chunk_kib`` per copy. ``shard.stage=2``:
    the stage's layers (``r.model.layers``) are units in groups of ``shard.unit_kib``, each
    micro-batch's gradient is reduce-scattered by group (:class:`StageUnitExchange`) and only the
    shard is summed. ``shard.stage=3``: the same units, gathered and reduce-scattered by the
    engine's :class:`StageUnits` (:class:`StageStage3Exchange`). The engine steps the returned
    optimizer over the shard's variable (:class:`ShardedUpdate`)."""
    if r.shard is None or r.shard.stage not in (1, 2, 3):
        raise HvdtrainError("shard.stage: TensorFlow's pipeline stages shard at stages 1-3 only")
    if r.shard.stage == 3:
        check_model(r.model)
        variables = list(r.params)
        unit = UnitShard(variables, layer_units(r.model.layers, variables), r.rank, r.size,
                         max(1, r.shard.unit_kib * 256), r.process_set)
        gathers = 2 if r.shard.reshard_after_forward else 1
        return (StageStage3Exchange(unit, r.comm.compression, r.accumulation, gathers),
                r.optimizer)
    if r.shard.stage == 2:
        variables = list(r.params)
        units = layer_units(r.model.layers, variables)
        unit = UnitShard(variables, units, r.rank, r.size, max(1, r.shard.unit_kib * 256),
                         r.process_set)
        return StageUnitExchange(unit, r.comm.compression, r.accumulation), r.optimizer
    shard = FlatShard(list(r.params), r.rank, r.size, chunk_elements(r.shard.chunk_kib),
                      r.process_set)
    return StageShardedExchange(shard, r.comm.compression), r.optimizer


def slice_creator(copy: int, copies: int) -> _SliceCreator:
    """The ``tf.variable_creator_scope`` creator under which a stage-3 stage builds its layers:
    each trainable variable cut to the copy's slice as it is made (:func:`stage_slices` finds
    them afterwards)."""
    return _SliceCreator(copy, copies)


def stage_slices(creator: _SliceCreator, model: Any) -> list[np.ndarray]:
    """The copy's slice of each of ``model``'s trainable variables, made under ``creator``, in
    ``model.trainable_variables``' order."""
    by_storage = {id(storage): piece for storage, piece in creator.made}
    try:  # outside a layer's call ``value`` is the storage itself (no autocast)
        return [by_storage.pop(id(v.value)) for v in model.trainable_variables]
    except KeyError:
        raise HvdtrainError("shard.stage=3 with pipeline stages: a trainable variable was not "
                            "created while the stage was built; use shard.stage=2") from None


class StageUnits(Stage3Units):
    """:class:`~hvdtrain.tensorflow.shard3.Stage3Units` among one stage's copies (the shard's
    process set). While the variables are whole (:meth:`materialise`: evaluation,
    ``parameters()``, a checkpoint) a layer's call runs on them without gathering, so that each
    copy may evaluate its own number of batches."""

    def _wrapped(self, k: int, call: Callable[..., Any], unit: list[int]) -> Callable[..., Any]:
        gathering = super()._wrapped(k, call, unit)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            # Read when traced: a training pass is traced while the variables are released.
            return gathering(*args, **kwargs) if self.released else call(*args, **kwargs)

        return wrapped

    def start_from(self, restored: bool, root: int) -> None:
        """The shard's values at the start of a run (a collective in the stage's set): each
        variable's slice as built, or, where copy 0 (job rank ``root``) restored the stage whole
        from a checkpoint, broadcast from it a variable at a time, each copy keeping its slice.
        The stage's variables are empty afterwards."""
        pieces = self._slices
        if restored:
            pieces = []
            for i, v in enumerate(self.variables):
                value = v.value if self.shard.rank == 0 else tf.zeros(v.shape, v.dtype)
                got = hvd.broadcast(tf.convert_to_tensor(value), root_rank=root,
                                    name=f"hvdtrain.stage.shard3.model.{i}",
                                    process_set=self.shard.process_set)
                lo, hi = self.shard.bounds[i]
                pieces.append(tf.reshape(got, [-1])[lo:hi].numpy())
                v.value.assign(tf.zeros([0], v.dtype))  # one variable whole at a time
        if pieces is not None:
            self.shard.var.assign(np.concatenate(pieces) if pieces else np.zeros(0, np.float32))
        self._slices = None
        self.release()


class ScatteredPasses:
    """The passes of a stage at ``shard.stage=2`` (a mixin before the stage's kernels): each
    micro-batch's gradient is reduce-scattered among the stage's copies as its backward pass
    ends (a collective in the stage's set), and only the copy's averaged shard is summed over
    the step, so no whole gradient outlives a pass.

    The copies pair their reduce-scatters by their order in the step. A short last step can
    leave one copy fewer non-empty micro-batches than another (the sampler deals the samples
    out in turn); the runner skips a copy's empty ones, so after the schedule :meth:`gradients`
    reduce-scatters zeros for each of them: every copy runs one reduce-scatter per micro-batch
    of the step. Zeros add nothing to the average, whose weights (each copy's share of the
    step's samples) already count the samples each copy had, so the update is still the mean
    over the global batch."""

    shard: Any
    sharded: StageShardedExchange | StageUnitExchange
    variables: list[Any]
    microbatches: int

    def __init__(self, *args: Any, microbatches: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.microbatches = microbatches
        self._mine: tf.Tensor | None = None
        self._scattered = 0
        grads = [tf.TensorSpec(v.shape, tf.float32) for v in self.variables]
        self._scatter_fn = _traced(self._scatter, [grads])

    def _scatter(self, grads: list[tf.Tensor]) -> tf.Tensor:
        return self.shard.reducescatter(grads, self.sharded.wire)

    def begin(self) -> None:
        self._mine, self._scattered = None, 0  # no whole sums (the stage's kernels keep them)

    def _add(self, grads: list[tf.Tensor]) -> None:
        began = time.perf_counter()
        mine = self._scatter_fn(grads)
        assert isinstance(self.sharded, StageUnitExchange), "stage 2's exchange"
        self.sharded.scatter_s += time.perf_counter() - began
        self._mine = mine if self._mine is None else self._mine + mine
        self._scattered += 1

    def gradients(self) -> list[tf.Tensor]:
        """The averaged shard of the step's gradient, after a zero reduce-scatter for each
        micro-batch this copy had no samples in."""
        if self._scattered < self.microbatches:
            zeros = [tf.zeros(v.shape, tf.float32) for v in self.variables]
            while self._scattered < self.microbatches:
                self._add(zeros)
        assert self._mine is not None
        mine, self._mine = self._mine, None
        return [mine]


class ShardedUpdate:
    """The stage kernels' update when the stage is sharded (a mixin before
    :class:`hvdtrain.tensorflow.pipeline.TensorFlowStageKernels`): the averaged shard of the
    gradient steps the shard's variable, then the shards are all-gathered into the stage's
    layers. Forward, backward and the messages are the stage's own."""

    shard: FlatShard | UnitShard
    sharded: StageShardedExchange | StageUnitExchange
    optimizer: Any
    precision: Any
    l2: float
    apply: Any

    def _compile(self) -> None:
        super()._compile()  # type: ignore[misc]
        signature = [[tf.TensorSpec([self.shard.own], tf.float32)]]
        self._apply_shard_fn = _traced(self._apply_shard, signature)
        self.apply = self._update
        self.precision.attach(self.optimizer, self._update, [(self.shard.own,)])

    def _apply_shard(self, grads: list[tf.Tensor]) -> None:
        """The optimizer's update of the shard variable with its averaged gradient. Pipeline
        stages train in fp32 without clipping (the config refuses both), so neither a loss
        scale's overflow vote nor a norm spans the copies here."""
        self.precision.note(grads)
        var = self.shard.var
        if self.l2:  # as the stage's: L2 on the gradient, element by element
            grads = [g + self.precision.scale(self.optimizer, self.l2 * var.value) for g in grads]
        self.optimizer.apply_gradients(zip(grads, [var], strict=True))

    def _update(self, grads: list[tf.Tensor]) -> None:
        """Steps the shard, then all-gathers every copy's shard back into the stage's layers (a
        collective in the stage's set, counted as communication)."""
        self._apply_shard_fn(grads)
        began = time.perf_counter()
        self.shard.store()
        self.sharded.stats["comm_s"] += time.perf_counter() - began


def per_element(var: Any) -> bool:
    """Whether an optimizer variable is a slot of the shard (one value per element) rather than a
    scalar (the step count, the learning rate, a loss scale)."""
    return len(var.shape) == 1


class _SlotPiece:
    """One variable's piece of a whole slot, as a checkpoint entry: its value read from, and
    assigned into, the slot's flat vector that :class:`ShardSlots` holds."""

    def __init__(self, slots: ShardSlots, index: int, offset: int, shape: tuple[int, ...]) -> None:
        self.slots, self.index, self.offset, self.shape = slots, index, offset, shape
        self.size = int(np.prod(shape))

    def numpy(self) -> np.ndarray:
        whole = self.slots.whole[self.index]
        return whole[self.offset:self.offset + self.size].reshape(self.shape).copy()

    def assign(self, value: np.ndarray) -> None:
        whole = self.slots.whole.setdefault(
            self.index, np.zeros(self.slots.shard.total, np.float32))
        whole[self.offset:self.offset + self.size] = np.asarray(value, np.float32).reshape(-1)


class ShardSlots:
    """A sharded stage's optimizer state as the checkpoint entries of a stage without sharding
    (see the module docstring). ``names``: the global names of the stage's trainable variables,
    in the shard's order."""

    def __init__(self, shard: FlatShard | UnitShard, optimizer: Any, names: Sequence[str]
                 ) -> None:
        self.shard, self.optimizer, self.names = shard, optimizer, list(names)
        self.whole: dict[int, np.ndarray] = {}
        """Whole slots by optimizer variable index: gathered for a checkpoint, or restored."""
        ref = shard.var.path.replace("/", "_")
        self._kinds = {i: v.name[len(ref) + 1:] for i, v in enumerate(optimizer.variables)
                       if per_element(v) and v.name.startswith(ref + "_")}
        if len(self._kinds) != sum(per_element(v) for v in optimizer.variables):
            raise HvdtrainError("shard.stage with pipeline stages: an optimizer slot that is not "
                                "the shard's")

    def entries(self) -> dict[str, Any]:
        """The optimizer's checkpoint entries: each slot per variable by global name, and the
        optimizer's scalars (``optimizer/opt/<name>``)."""
        found: dict[str, Any] = {f"optimizer/opt/{v.name}": v for v in self.optimizer.variables
                                 if not per_element(v)}
        for i, kind in self._kinds.items():
            for name, offset, variable in zip(self.names, self.shard.offsets,
                                              self.shard.variables, strict=True):
                found[f"optimizer/{name}/{kind}"] = _SlotPiece(self, i, offset,
                                                              tuple(variable.shape))
        return found

    def gather(self) -> None:
        """Every slot whole on every copy (a collective in the stage's set)."""
        self.whole = {i: self.shard.allgather(tf.convert_to_tensor(
            self.optimizer.variables[i].value), f"state.{i}").numpy() for i in self._kinds}

    def scatter(self, restored: bool, root: int, load: bool = True) -> None:
        """After a restore (``restored``: on every copy), each copy's slice of copy 0's whole
        slots (a broadcast in the stage's set from ``root``, copy 0's job rank); where
        ``load``, the shard variable from the stage's parameters (which the broadcasts made
        equal; at stage 3 :meth:`StageUnits.start_from` set it)."""
        if restored:
            for i in self._kinds:
                mine = self.whole.get(i)
                sent = tf.constant(mine) if mine is not None else tf.zeros([self.shard.total])
                got = hvd.broadcast(sent, root, name=f"hvdtrain.stage.shard.slot.{i}",
                                    process_set=self.shard.process_set)
                self.optimizer.variables[i].assign(self.shard.take(got))
        self.whole = {}
        if load:
            self.shard.load()

    def scalars(self) -> list[Any]:
        """The optimizer's variables that every copy holds whole (broadcast as they are)."""
        return [v for v in self.optimizer.variables if not per_element(v)]


def slot_entries(entries: Mapping[str, Any], slots: ShardSlots | None) -> dict[str, Any]:
    """A stage's checkpoint entries with its optimizer's replaced by ``slots``' where the stage
    is sharded."""
    if slots is None:
        return dict(entries)
    return {**{k: v for k, v in entries.items() if not k.startswith("optimizer/")},
            **slots.entries()}
