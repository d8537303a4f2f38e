"""Sharded data parallel at stage 1 for TensorFlow (``shard.stage=1``): the sharded update.

The same update as :mod:`hvdtrain.torch.shard`, on ``horovod.tensorflow`` ops: every rank owns
1/N of the flat trainable parameters (:mod:`hvdtrain.shard` says which, split as Horovod's
``reducescatter`` splits a vector). A step reduce-scatters the flat gradient with ``Average``
(:class:`ShardedExchange`), the run's Keras optimizer steps one variable holding this rank's
shard of the parameters (:class:`ShardedKernels`), so its slots cover 1/N of the model, and the
updated shards are all-gathered back into every rank's model variables. The reduce-scatter runs in
rounds of at most ``shard.chunk_kib`` per rank, each cut from the variables it covers (no flat
copy of the gradient is made); the all-gather brings back whole variables, grouped up to a
round's size. The arithmetic is the ring's (an average, then the same element-wise update), so a
sharded run trains as a ring run of the same ranks.

Memory (docs/benchmarks.md, "TensorFlow sharded data parallel"): a sharded engine switches
TensorFlow to the C library's allocator with freed blocks returned (:func:`return_freed_memory`),
because oneDNN's pool would keep every step's transients; and no whole vector of every parameter
is made, in a step or in the start-up broadcast.

Checkpoints (:class:`ShardedEngine`): every rank writes its slices of each per-element optimizer
slot, and at stage 3 of the parameters, to its own part (:mod:`hvdtrain.tensorflow.shard_files`);
rank 0's file holds the rest (the model whole at stages 1-2, empty trainable entries at stage 3;
the optimizer's scalars). A run resumes at any stage 1-3 and world size, each rank reading its
own slices; the ring reads such a checkpoint a variable at a time (``TensorFlowEngine.load_state``).
A checkpoint that holds variables whole (the ring's, or one written before) is handed out by
rank 0 a variable at a time (:mod:`hvdtrain.tensorflow.shard_whole`); one of every slot whole as
a flat vector: rank 0 broadcasts it, every rank takes its own slice.

Keras 3: a Keras variable is not a ``tf.Variable``; values are read and assigned through Keras.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from hvdtrain.config import Config
from hvdtrain.data.contracts import Dataset
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import GradientExchange
from hvdtrain.malloc import return_freed_blocks
from hvdtrain.shard import (
    check_resize,
    pieces,
    round_ranges,
    segments,
    shard_bounds,
    step_bytes,
)
from hvdtrain.tensorflow import rng, syncbn
from hvdtrain.tensorflow.collectives import any_rank
from hvdtrain.tensorflow.data import batch_signature
from hvdtrain.tensorflow.engine import TensorFlowEngine, l2_decay, make_optimizer
from hvdtrain.tensorflow.shard3 import (
    Stage3Exchange,
    Stage3Kernels,
    Stage3Units,
    build_in_slices,
    free_fusion_buffer,
    gather_model,
    make_stage3,
)
from hvdtrain.tensorflow.shard_files import (
    SLOT_KINDS,
    layout_of,
    read_params,
    read_slots,
    shard_part,
    sharded_source,
    slot_kinds,
)
from hvdtrain.tensorflow.shard_grads import (
    UnitExchange,
    UnitKernels,
    UnitShard,
    agree_overflow,
    clip_shards,
    layer_units,
    unit_groups,
)
from hvdtrain.tensorflow.shard_whole import hand_out, ring_names, ring_scalars, ring_slots
from hvdtrain.tensorflow.step import TensorFlowKernels, _traced

_WIRE = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


class FlatShard:
    """This rank's shard of the model's flat trainable parameters, and the rounds of the two
    collectives that move shards (``chunk``: elements per rank in one round). ``process_set``:
    Horovod's set of the ranks that share the shards (a pipeline stage's copies; ``rank`` and
    ``size`` are the place and number in it), every rank's by default."""

    def __init__(self, variables: Sequence[Any], rank: int, size: int, chunk: int,
                 process_set: Any = None) -> None:
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self.variables = list(variables)
        for v in self.variables:
            if v.dtype != "float32":
                raise HvdtrainError("shard.stage=1: every trainable variable must be float32")
        self.sizes = [int(np.prod(v.shape)) for v in self.variables]
        self.total, self.rank, self.size, self.chunk = sum(self.sizes), rank, size, chunk
        self.start, self.stop = shard_bounds(self.total, size, rank)
        self.own = self.stop - self.start
        self.offsets = [sum(self.sizes[:j]) for j in range(len(self.sizes))]
        self._groups = unit_groups(self.sizes, chunk * size)  # :meth:`store`'s all-gathers
        # The variable the optimizer steps: this rank's slice of the parameters.
        self.var = keras.Variable(np.zeros(self.own, np.float32), name="shard")

    def _pieces(self, tensors: Sequence[Any], lo: int, hi: int) -> list[tf.Tensor]:
        """The flat range [lo, hi) of ``tensors`` (one per variable), cut from each variable it
        covers: no flat copy of every variable is made."""
        return [tf.reshape(tf.cast(tensors[s.param], tf.float32), [-1])[
            s.offset:s.offset + s.length] for s in segments(self.sizes, lo, hi)]

    def load(self) -> None:
        """The shard variable from the model's current parameters (after a broadcast or a
        restore; the update keeps the two equal from there)."""
        values = [v.value for v in self.variables]
        self.var.assign(tf.concat(self._pieces(values, self.start, self.stop), 0))

    def take(self, whole: Any) -> Any:
        """This rank's shard of a flat vector of every parameter (a slot as checkpoints hold
        it)."""
        return whole[self.start:self.stop]

    def reducescatter(self, grads: Sequence[tf.Tensor], wire: Any) -> tf.Tensor:
        """The average over the ranks of this rank's shard of the flat gradient (``grads``: one
        per variable), in rounds each cut from the variables it covers (a collective)."""
        got = []
        for k in range(pieces(self.total, self.size, self.chunk)):
            ranges = round_ranges(self.total, self.size, self.chunk, k)
            send = tf.concat([p for lo, hi in ranges for p in self._pieces(grads, lo, hi)], 0)
            got.append(hvd.reducescatter(send, op=hvd.Average, compression=wire,
                                         name=f"hvdtrain.shard.grads.{k}",
                                         process_set=self.process_set))
        return tf.concat(got, 0)

    def allgather(self, mine: tf.Tensor, tag: str) -> tf.Tensor:
        """Every rank's ``mine`` (a per-element tensor of its shard) as the whole flat vector, in
        the same rounds as :meth:`reducescatter` (a collective)."""
        by_rank: list[list[tf.Tensor]] = [[] for _ in range(self.size)]
        for k in range(pieces(self.total, self.size, self.chunk)):
            ranges = round_ranges(self.total, self.size, self.chunk, k)
            a, b = ranges[self.rank]
            got = hvd.allgather(mine[a - self.start:b - self.start],
                                name=f"hvdtrain.shard.{tag}.{k}", process_set=self.process_set)
            at = 0
            for r, (lo, hi) in enumerate(ranges):
                by_rank[r].append(got[at:at + hi - lo])
                at += hi - lo
        # Rank r's pieces, in round order, are its shard; the shards, in rank order, the vector.
        return tf.concat([piece for pieces_of in by_rank for piece in pieces_of], 0)

    def store(self) -> None:
        """Every rank's updated shard written back into the model's variables (a collective):
        one grouped all-gather of each rank's part of each variable (empty where its shard
        misses the variable), whose result is that variable whole, in groups of at most a
        round's elements (a larger variable alone). Only a group's variables are ever held
        twice."""
        mine = self.var.value
        for g, group in enumerate(self._groups):
            parts = []
            for j in group:
                lo = max(self.start, self.offsets[j])
                hi = max(lo, min(self.stop, self.offsets[j] + self.sizes[j]))
                parts.append(mine[lo - self.start:hi - self.start])
            whole = hvd.grouped_allgather(parts, name=f"hvdtrain.shard.params.{g}",
                                          process_set=self.process_set)
            for j, flat in zip(group, whole, strict=True):
                self.variables[j].assign(tf.reshape(flat, self.variables[j].shape))


class ShardedExchange(GradientExchange):
    """Horovod's ``reducescatter`` of the flat gradient, in rounds: each rank gets the average of
    its own shard (one tensor), which :class:`ShardedKernels` steps and all-gathers back.
    ``wire_bytes`` counts what a rank hands Horovod a step: the whole gradient (float16 under
    ``fp16``) and its float32 shard; ``dense_bytes`` the same in float32."""

    def __init__(self, shard: FlatShard, compression: str) -> None:
        self.shard, self.rank, self.size = shard, shard.rank, shard.size
        self.wire = _WIRE[compression]
        self._bytes = step_bytes(shard.total, shard.own, compression)
        self.stats = {"wire_bytes": 0.0, "dense_bytes": 0.0, "comm_s": 0.0, "compress_s": 0.0}

    def run(self, grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        began = time.perf_counter()
        mine = self.shard.reducescatter(grads, self.wire)
        wire, dense = self._bytes
        # The kernels' update adds the all-gather's wait before the step reads these.
        self.stats = {"wire_bytes": wire, "dense_bytes": dense, "compress_s": 0.0,
                      "comm_s": time.perf_counter() - began}
        return [mine]

    def any_rank(self, flag: bool) -> bool:
        return any_rank(flag)

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        check_resize(self.rank, self.size, rank, size)


class ShardedKernels(TensorFlowKernels):
    """The TensorFlow kernels whose update steps this rank's shard with the run's optimizer and
    all-gathers the shards back into the model (forward and backward are the ring's)."""

    def __init__(self, *args: Any, shard: FlatShard, exchange: ShardedExchange,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shard, self.sharded = shard, exchange

    def _compile(self) -> None:
        super()._compile()
        signature = [[tf.TensorSpec([self.shard.own], tf.float32)]]
        self._apply_shard_fn = _traced(self._apply_shard, signature)
        self.apply = self._update
        self.precision.attach(self.optimizer, self._update, [(self.shard.own,)])

    def _apply_shard(self, grads: list[tf.Tensor]) -> None:
        """The optimizer's update of the shard variable with its averaged gradient."""
        if self.precision.scaling:  # fp16: skipped on every rank, or on none
            grads = agree_overflow(grads)
        self.precision.note(grads)
        var = self.shard.var
        if self.clip_norm:  # the norm of the whole gradient, summed over the shards
            grads = clip_shards(grads, self.clip_norm)
        if self.l2:  # as the ring's: L2 on the gradient, element by element
            grads = [g + self.precision.scale(self.optimizer, self.l2 * var.value) for g in grads]
        self.optimizer.apply_gradients(zip(grads, [var], strict=True))

    def _update(self, grads: list[tf.Tensor]) -> None:
        """Steps the shard (equal to its part of the parameters since the last all-gather or
        :meth:`FlatShard.load`), and all-gathers every shard back (a collective); the
        all-gather's wait counts as communication."""
        self._apply_shard_fn(grads)
        began = time.perf_counter()
        self.shard.store()
        self.sharded.stats["comm_s"] += time.perf_counter() - began


def _per_element(var: Any) -> bool:
    """Whether an optimizer variable is a slot of the shard (per element) rather than a scalar
    (the step count, the learning rate)."""
    return len(var.shape) == 1


SYSTEM_ALLOCATOR = "TF_ONEDNN_USE_SYSTEM_ALLOCATOR"
"""TensorFlow's switch from oneDNN's CPU allocator to the C library's (read at its first
allocation)."""


def return_freed_memory() -> None:
    """Lets the memory TensorFlow frees leave the process (unless the user set
    ``TF_ONEDNN_USE_SYSTEM_ALLOCATOR``): with oneDNN on (TensorFlow's default on x86), its CPU
    allocator serves large tensors from a BFC pool that never shrinks, so every transient of a
    step (a round's pieces, a variable gathered whole, the optimizer's temporaries) stays
    resident for the rest of the run, and the pool grows by doubling. The C library's allocator
    with glibc's mmap threshold pinned (:func:`hvdtrain.malloc.return_freed_blocks`) gives
    large blocks back when freed. Set before the engine's first tensor, which TensorFlow reads it
    at; a process that already allocated keeps the pool."""
    os.environ.setdefault(SYSTEM_ALLOCATOR, "1")
    return_freed_blocks()


class ShardedEngine(TensorFlowEngine):
    """The TensorFlow engine with ``shard.stage`` 1-3 (the update of :class:`ShardedKernels`,
    of shard_grads.py or of shard3.py) and its checkpoints written by every rank (see the module
    docstring)."""

    def __init__(self, cfg: Config, dataset: Dataset) -> None:
        return_freed_memory()
        if cfg.shard.stage >= 3:  # before Horovod starts
            free_fusion_buffer()
        self._made = (cfg, dataset)  # elastic mode builds the model again to re-shard it
        super().__init__(cfg, dataset)

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        if (rank, size) == (self.exchange.rank, self.exchange.size):
            super().resize(rank, size, accumulation)
            return
        # The shards are cut for another world: reshard() makes them again for this one (until
        # then a step refuses, in the exchange's resize).
        self.rank, self.size, self.accumulation = rank, size, accumulation
        self.layout = self.layout.resized(size)
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()

    def reshard(self) -> None:
        # The shards' bounds, units and traced functions are cut for one world: the model (at
        # stage 3 its layers' calls are wrapped and its variables emptied), the optimizer and
        # the update are made again for this one, as at the start, and the committed state is
        # then loaded into them (load_state, broadcast_state). The random streams go on.
        streams = rng.capture()
        cfg, dataset = self._made
        with self.precision.policy():
            self.model = self._build(cfg, dataset)
        if cfg.model.sync_batchnorm:
            syncbn.convert(self.model)
        self._source, self._file = None, None  # _make_update empties _whole
        self._make_update(cfg, self.model.trainable_variables)
        self._eval_fn = tf.function(self._eval_batch, input_signature=batch_signature(self.spec),
                                    jit_compile=False)
        rng.restore(streams)

    def _build(self, cfg: Config, dataset: Dataset) -> keras.Model:
        if cfg.shard.stage < 3:
            return super()._build(cfg, dataset)
        # Stage 3: each variable cut to this rank's slice as it is made (shard3.py).
        model, slices = build_in_slices(lambda: super(ShardedEngine, self)._build(cfg, dataset),
                                        cfg.seed, self.rank, self.size)
        self._slices: list[np.ndarray] = slices  # Stage3Units takes them
        return model

    def _make_update(self, cfg: Config, variables: Sequence[Any]) -> None:
        self.optimizer = self.precision.wrap(make_optimizer(cfg.optim))
        self.shard: FlatShard | UnitShard
        self.units: Stage3Units | None = None
        if cfg.shard.stage >= 3:  # hvdtrain/tensorflow/shard3.py
            self.shard = make_stage3(self.model, variables, self.rank, self.size,
                                     cfg.shard.unit_kib)
            self.exchange = Stage3Exchange(self.shard, cfg.comm.compression, self.accumulation,
                                           2 if cfg.shard.reshard_after_forward else 1)
            self.units = Stage3Units(self.model, self.shard, cfg.shard.prefetch,
                                     cfg.shard.reshard_after_forward, self.exchange.wire,
                                     self._slices)
            self._slices = []
            self.kernels = Stage3Kernels(
                self.model, self.optimizer, self.adapter, self.data, self.precision, self.spec,
                l2=l2_decay(cfg.optim, False), shard=self.shard, units=self.units)
        elif cfg.shard.stage >= 2:
            self.shard = UnitShard(variables, layer_units(self.model.layers, variables),
                                   self.rank, self.size, cfg.shard.unit_kib * 256)
            self.exchange = UnitExchange(self.shard, cfg.comm.compression, self.accumulation)
            self.kernels = UnitKernels(
                self.model, self.optimizer, self.adapter, self.data, self.precision, self.spec,
                l2=l2_decay(cfg.optim, False), shard=self.shard)
        else:
            self.shard = FlatShard(variables, self.rank, self.size,
                                   max(1, cfg.shard.chunk_kib * 256))
            self.exchange = ShardedExchange(self.shard, cfg.comm.compression)
            self.kernels = ShardedKernels(
                self.model, self.optimizer, self.adapter, self.data, self.precision, self.spec,
                l2=l2_decay(cfg.optim, False), shard=self.shard, exchange=self.exchange)
        self.optimizer.build([self.shard.var])
        self.kernels.clip_norm = cfg.optim.clip_norm
        self.kernels.follow(self.exchange, self.accumulation)
        self._whole: dict[int, np.ndarray] = {}  # rank 0: slots gathered or restored, by index

    _source: dict[str, Any] | None = None  # rank 0: a checkpoint of shards to read
    _wrote_shards = False  # every rank wrote its slots' slices: rank 0's file holds the rest

    def _slots(self) -> dict[int, Any]:
        """The per-element slots by optimizer variable index (the variables: a part reads them
        a piece at a time, so no copy of a whole slot is made)."""
        return {i: v for i, v in enumerate(self.optimizer.variables) if _per_element(v)}

    def shard_part(self) -> tuple[str, dict[str, Any], Any] | None:
        # Every rank its own slices of each slot (hvdtrain/tensorflow/shard_files.py), and at
        # stage 3 of the parameters: nothing is gathered, and rank 0's file holds the model's
        # trainable variables as the rank does between steps, empty.
        self._wrote_shards = True
        params = self.shard.var if self.units is not None and self.units.released else None
        return shard_part(self.shard, self._slots(), self.rank, params)

    def state_bytes(self, meta: dict[str, Any]) -> bytes:
        if self._wrote_shards:  # the layout in the meta; empty slots (_optimizer_arrays)
            slots = self._slots()
            meta = {**meta, "shards": layout_of(self.shard, slots).to_dict(),
                    SLOT_KINDS: slot_kinds(slots, self.shard.var)}
        return super().state_bytes(meta)

    reads_shards = True
    _params_in_parts = False  # the state's model entries were empty: stage 3 wrote them in parts
    _file: dict[str, Any] | None = None  # rank 0: a whole checkpoint's entries to hand out
    _ring: dict[str, int] | None = None  # a ring's checkpoint: its optimizer's global names

    def load_state(self, data: bytes, where: str) -> dict[str, Any]:
        self._params_in_parts, self._file = False, {"params": {}, "slots": {}}
        self._ring = ring_names(data, where)
        meta = super().load_state(data, where)
        if self._ring is not None:  # its slots per variable: handed out in broadcast_state
            self._file["slots"] = ring_slots(data, self._ring, self.model, self._slots(),
                                             self.shard.var, where)
            ring_scalars(data, self._ring, self.optimizer, _per_element, where)
        got = self._file["params"]
        if got and len(got) != len(self.shard.sizes):
            raise HvdtrainError(f"{where}: its model entries are partly empty")
        self._file = self._file if any(self._file.values()) else None
        if self._file is not None:  # read again from the file, a variable at a time
            if self.restore_from is None:
                raise HvdtrainError(f"{where}: a whole checkpoint is read from its file only")
            self._file["path"] = str(self.restore_from)
        if meta.get("shards") is not None:  # every rank reads its slices in broadcast_state
            self._source = {**sharded_source(meta, self.restore_from, where),
                            "params": self._params_in_parts}
        elif self._params_in_parts:
            raise HvdtrainError(f"{where}: its model entries are empty and it has no parts")
        return meta

    def gather_state(self) -> None:
        # Every slot whole onto rank 0 (every rank joins the collectives, only rank 0 keeps).
        self._whole = {}
        for i, var in enumerate(self.optimizer.variables):
            if _per_element(var):
                whole = self.shard.allgather(tf.convert_to_tensor(var.value), f"state.{i}")
                if self.rank == 0:
                    self._whole[i] = whole.numpy()

    def _optimizer_arrays(self) -> list[np.ndarray]:
        if self._wrote_shards:  # the slots are in the parts: empty entries here
            self._wrote_shards = False
            return [np.zeros(0, np.float32) if _per_element(v) else v.numpy()
                    for v in self.optimizer.variables]
        if self.shard.size > 1 and not all(
                i in self._whole for i, v in enumerate(self.optimizer.variables)
                if _per_element(v)):
            raise HvdtrainError("shard.stage: the optimizer state is written after "
                                "gather_state() only, on rank 0")
        arrays = [self._whole.get(i, v.numpy()) if _per_element(v) else v.numpy()
                  for i, v in enumerate(self.optimizer.variables)]
        self._whole = {}
        return arrays

    def parameters(self) -> dict[str, np.ndarray]:
        if self.units is None or not self.units.released:
            return super().parameters()
        # Stage 3: gathered one group at a time (a collective: every rank asks)
        return {f"{i}.{v.name}": value for i, (v, value) in enumerate(zip(
            self.model.trainable_variables, gather_model(self.units.shard, True), strict=True))}

    def _global_names(self) -> dict[str, np.ndarray]:
        return {}  # the optimizer's slots are flat, not by layer: no pipeline stage reads them

    def _restore(self, var: Any, value: np.ndarray, name: str, where: str) -> None:
        size = int(np.prod(var.shape))
        if name.startswith("model/") and var.trainable and size > 0:
            if value.shape == (0,):  # stage 3 wrote the parameters in the parts
                self._params_in_parts = True
                return
            if self.units is not None and value.shape == tuple(var.shape):
                # Stage 3 from a whole model: rank 0 hands it out a variable at a time from
                # the file (broadcast_state); the rank's variables stay empty.
                assert self._file is not None
                j = [id(v) for v in self.model.trainable_variables].index(id(var))
                self._file["params"][j] = name
                return
        if name.startswith("optimizer/") and self._ring is not None:
            return  # a ring's: by global names (load_state)
        if name.startswith("optimizer/") and _per_element(var):
            if value.shape == (0,):  # in the parts (load_state checks the layout is there)
                return
            if value.shape != (self.shard.total,):
                raise HvdtrainError(f"{where}: {name} has shape {value.shape}, a sharded run "
                                    f"keeps its optimizer slots flat ({self.shard.total},): it "
                                    "resumes from checkpoints of shard.stage 1 or 2 only")
            self._whole[int(name.split("/")[1])] = value  # the broadcast hands out the slices
            var.assign(self.shard.take(value))
            return
        super()._restore(var, value, name, where)

    def broadcast_state(self) -> None:
        # The model and the optimizer's scalars from rank 0; each slot as rank 0 restored it
        # (zeros where it restored none, as every rank's are on a fresh start), each rank
        # keeping its own slice.
        scalars = [v for v in self.optimizer.variables if not _per_element(v)]
        model = self.model.variables if self.units is None else []  # stage 3: Stage3Units.start
        # By position: Horovod names a broadcast after its variable, and Keras's names count the
        # objects a process made, so a worker joining an elastic run has other names.
        for i, v in enumerate([*model, *scalars]):
            v.assign(hvd.broadcast(tf.convert_to_tensor(v.value), root_rank=0,
                                   name=f"hvdtrain.shard.state.{i}"))
        told = hvd.broadcast_object((self._source, sorted(self._whole), self._file)
                                    if self.rank == 0 else None, root_rank=0,
                                    name="hvdtrain.shard.files")
        source, whole, file = told
        self._source, self._file = None, None
        slots = {} if file is None else file["slots"]
        if source is not None:  # from a checkpoint of shards: each rank reads its own slices
            indices = [i for i, v in enumerate(self.optimizer.variables) if _per_element(v)]
            slots = read_slots(source, self.shard, indices)
            for i, values in slots.items():
                self.optimizer.variables[i].assign(values)
        for i, var in enumerate(self.optimizer.variables):
            if not _per_element(var) or source is not None:
                continue
            if i in slots:  # a ring's: a variable at a time
                var.assign(hand_out(self.shard, slots[i], file, f"slot.{i}"))
            elif i in whole:  # restored whole on rank 0: one slot at a time, each its slice
                mine = self._whole.get(i) if self.rank == 0 else None
                got = hvd.broadcast(tf.constant(mine) if mine is not None
                                    else tf.zeros([self.shard.total]), root_rank=0,
                                    name=f"hvdtrain.shard.slot.{i}")
                var.assign(self.shard.take(got))
            else:  # nothing to send: no whole vector is made (it would peak at 3 of them)
                var.assign(tf.zeros([self.shard.own]))
        self._whole = {}
        if self.units is not None:  # stage 3: the rank keeps its slices only
            self.units.start()
            if file is not None and file["params"]:  # a whole model: a variable at a time
                self.shard.var.assign(hand_out(self.shard, file["params"], file, "params"))
        else:
            self.shard.load()  # the step keeps the shard and the parameters equal from here
        if source is not None and source.get("params"):  # stage 3 wrote them in the parts
            self.shard.var.assign(read_params(source, self.shard))
            if self.units is None:  # stages 1-2: the model whole on every rank
                self.shard.store()
        self._follow_world()
