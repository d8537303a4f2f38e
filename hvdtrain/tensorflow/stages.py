"""TensorFlow pipeline stages x sharded copies (``pipeline.stages`` > 1 with ``shard.stage`` 1
or 2): each stage's data-parallel copies shard that stage's optimizer state (and at stage 2 its
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
- **Checkpoints.** A stage's part holds its optimizer state in the layout of a stage without
  sharding: each slot by the global name of its variable (``optimizer/<layer>.<j>/<slot>``,
  :mod:`hvdtrain.tensorflow.parts`), gathered whole in the stage's set before copy 0 writes it
  (:class:`ShardSlots`). A sharded pipeline therefore resumes from a pipeline checkpoint with or
  without sharding, of any split, and one without sharding from a sharded one. On resume copy 0
  reads the whole slots, and each copy takes its slice from copy 0's broadcast in the set.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import Exchanged, ExchangeRequest
from hvdtrain.ps.layout import chunk_elements
from hvdtrain.tensorflow.collectives import any_rank
from hvdtrain.tensorflow.shard import FlatShard, ShardedExchange
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


def stage_sharded(r: ExchangeRequest) -> Exchanged:
    """``sharded`` among a stage's copies (``r.process_set``; ``r.rank``, ``r.size``: this copy
    and the copies). ``shard.stage=1``: the reduce-scatter of the step's summed gradient, the
    shard's update and all-gather, in rounds of ``shard.chunk_kib`` per copy. ``shard.stage=2``:
    the stage's layers (``r.model.layers``) are units in groups of ``shard.unit_kib``, each
    micro-batch's gradient is reduce-scattered by group (:class:`StageUnitExchange`) and only the
    shard is summed. The engine steps the returned optimizer over the shard's variable
    (:class:`ShardedUpdate`)."""
    if r.shard is None or r.shard.stage not in (1, 2):
        raise HvdtrainError("shard.stage: TensorFlow's pipeline stages shard at stages 1-2 only")
    if r.shard.stage == 2:
        variables = list(r.params)
        units = layer_units(r.model.layers, variables)
        unit = UnitShard(variables, units, r.rank, r.size, max(1, r.shard.unit_kib * 256),
                         r.process_set)
        return StageUnitExchange(unit, r.comm.compression, r.accumulation), r.optimizer
    shard = FlatShard(list(r.params), r.rank, r.size, chunk_elements(r.shard.chunk_kib),
                      r.process_set)
    return StageShardedExchange(shard, r.comm.compression), r.optimizer


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

    def scatter(self, restored: bool, root: int) -> None:
        """After a restore (``restored``: on every copy), each copy's slice of copy 0's whole
        slots (a broadcast in the stage's set from ``root``, copy 0's job rank); the shard
        variable from the stage's parameters (which the broadcasts made equal)."""
        if restored:
            for i in self._kinds:
                mine = self.whole.get(i)
                sent = tf.constant(mine) if mine is not None else tf.zeros([self.shard.total])
                got = hvd.broadcast(sent, root, name=f"hvdtrain.stage.shard.slot.{i}",
                                    process_set=self.shard.process_set)
                self.optimizer.variables[i].assign(self.shard.take(got))
        self.whole = {}
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
