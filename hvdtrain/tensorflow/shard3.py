"""Sharded data parallel at stage 3 for TensorFlow (``shard.stage=3``): parameters sharded too.

Between steps a rank holds only its slice of every trainable variable (the stage-2 layout of
:class:`hvdtrain.tensorflow.shard_grads.UnitShard`, in the one variable the optimizer steps): the
model's own variables are empty. No rank holds the model whole, not even while it is built
(:func:`build_in_slices`): each trainable variable is cut to this rank's slice as it is created,
before the next one is made, so building peaks at one variable whole beside the slices so far.
Every rank builds with rank 0's seed, so the slices are those of the model that rank 0 would
broadcast on the ring (and, resumed, rank 0's checkpoint is broadcast a variable at a time:
:meth:`Stage3Units.start`). A unit is one of
``model.layers`` with trainable variables; its ``call`` is wrapped in a ``tf.custom_gradient``
(:meth:`Stage3Units._unit`) whose forward all-gathers the unit's variables whole
(``hvd.grouped_allgather``) and runs the layer on them through a ``keras.StatelessScope``, and
whose backward gathers them again, runs the layer once more under its own tape (as
``tf.recompute_grad`` does: the outer tape keeps only the unit's input and its slices) and
reduce-scatters the weights' gradient into the rank's slices (``hvd.grouped_reducescatter``,
``Average``). The outer tape's gradient with respect to the shard variable is then the average of
this rank's slices, which the run's optimizer steps as at stage 2; nothing is all-gathered after
the step.

``shard.prefetch`` p: a unit's forward gather waits for the input of the unit p before it (so
p units' gathers run ahead of the computation), its backward gather for the output gradient of
the unit p after it. ``shard.reshard_after_forward=false``: the backward pass reuses the
forward's gathered variables instead of gathering again, so the graph keeps every unit's gathered
variables from the forward pass to the backward pass (what a plain tape would hold).

Monitoring (``comm_time_s``): a step's wait for its collectives is the sum, over the units, of
the time from a unit's input (forward) or output gradient (backward) being ready to its gathered
variables being there, plus the time from the last unit's weight gradient to the last
reduce-scatter's result (:meth:`Stage3Units.waited`), as PyTorch's stage 3 counts its waits.

Memory: a stage-3 engine turns Horovod's fusion buffer off unless the user sized it
(:func:`free_fusion_buffer`).

Checkpoints: every rank writes its slices of the variables and of the optimizer's slots to its
own part, nothing gathered (:meth:`hvdtrain.tensorflow.shard.ShardedEngine.shard_part`), so
stages 1-3, the ring and any number of ranks resume each other's checkpoints.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from hvdtrain.errors import HvdtrainError
from hvdtrain.shard import shard_bounds
from hvdtrain.tensorflow.collectives import grouped_reducescatter
from hvdtrain.tensorflow.shard_grads import UnitExchange, UnitKernels, UnitShard, layer_units


def check_model(model: keras.Model) -> None:
    """The models stage 3 runs, as one-line errors: no non-trainable state (a forward pass under a
    ``StatelessScope`` would drop its updates), every trainable variable in one of
    ``model.layers``, each layer's variables one unit."""
    if model.non_trainable_variables:
        raise HvdtrainError(
            f"shard.stage=3 with framework='tensorflow': the model has non-trainable variables "
            f"({model.non_trainable_variables[0].path}: batch statistics or a seed generator), "
            "which stage 3 does not carry yet; use shard.stage=2")
    variables = model.trainable_variables
    units = layer_units(model.layers, variables)
    owners = [_owner(model.layers, variables[u[0]]) for u in units]
    if None in owners or len(set(owners)) != len(owners):
        raise HvdtrainError("shard.stage=3 with framework='tensorflow': every trainable variable "
                            "must belong to exactly one of model.layers, a layer's variables "
                            "consecutive; use shard.stage=2")


def _owner(layers: Sequence[Any], var: Any) -> int | None:
    for k, layer in enumerate(layers):
        if any(v is var for v in layer.trainable_variables):
            return k
    return None


class _SliceCreator:
    """A ``tf.variable_creator_scope`` creator that keeps this rank's slice of each trainable
    float variable (flattened, split as Horovod's reduce-scatter splits it) and gives Keras an
    empty storage of unknown shape instead: the variable's whole initial value lives only while
    it is being created. Other variables (a seed generator's state) are made as usual."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.made: list[tuple[tf.Variable, np.ndarray]] = []

    def __call__(self, next_creator: Callable[..., tf.Variable], **kwargs: Any) -> tf.Variable:
        dtype = tf.as_dtype(kwargs.get("dtype") or tf.float32)
        if not kwargs.get("trainable", True) or not dtype.is_floating:
            return next_creator(**kwargs)
        init = kwargs["initial_value"]
        with tf.init_scope():  # eagerly, even where Keras builds a layer inside a trace
            flat = tf.reshape(tf.convert_to_tensor(init() if callable(init) else init, dtype),
                              [-1])
            lo, hi = shard_bounds(int(flat.shape[0]), self.size, self.rank)
            # A copy of its own: a slice of a tensor may share (and keep) the whole buffer.
            piece = np.array(flat[lo:hi].numpy(), copy=True)
        del flat
        kwargs.update(initial_value=tf.zeros([0], dtype), shape=tf.TensorShape(None))
        storage = next_creator(**kwargs)
        self.made.append((storage, piece))
        return storage


def build_in_slices(build: Callable[[], keras.Model], seed: int, rank: int, size: int
                    ) -> tuple[keras.Model, list[np.ndarray]]:
    """``build()``'s model with every trainable variable empty, and this rank's slice of each
    (in ``model.trainable_variables``' order, flattened). It builds under rank 0's ``seed``, so
    that every rank's slices are cut from the same initial values (the ring broadcasts rank 0's),
    then gives ranks other than 0 their own stream (``seed + rank``) as the engine does. A layer
    must work out its output shape without reading its weights (Keras's built-in layers do)."""
    keras.utils.set_random_seed(seed)
    creator = _SliceCreator(rank, size)
    with tf.variable_creator_scope(creator):
        model = build()
    if rank:
        keras.utils.set_random_seed(seed + rank)
    by_storage = {id(storage): piece for storage, piece in creator.made}
    try:  # outside a layer's call ``value`` is the storage itself (no autocast)
        slices = [by_storage.pop(id(v.value)) for v in model.trainable_variables]
    except KeyError:
        raise HvdtrainError("shard.stage=3 with framework='tensorflow': a trainable variable was "
                            "not created while the model was built; use shard.stage=2") from None
    return model, slices


FUSION_THRESHOLD = "HOROVOD_FUSION_THRESHOLD"
"""Horovod's fusion buffer size in bytes (64 MiB by default), read when Horovod starts."""


def free_fusion_buffer() -> None:
    """Turns Horovod's fusion buffer off (unless the user set ``HOROVOD_FUSION_THRESHOLD``),
    before Horovod starts: stage 3 groups a unit's tensors into one grouped collective itself,
    and the buffer, once a collective used it, stays resident at its full size (64 MiB above
    ZeRO's formula on every rank: docs/benchmarks.md, "TensorFlow sharded data parallel: peak
    memory per rank"). A process whose Horovod already started keeps its buffer."""
    os.environ.setdefault(FUSION_THRESHOLD, "0")


def _autocast_now() -> Callable[[], Any]:
    """The autocast scope in force (``Layer.__call__`` opens one around the call of a layer of a
    mixed policy: float16 compute on float32 variables), as a factory of a context that
    re-enters it: the backward pass recomputes the layer outside ``Layer.__call__``. Keras 3
    has no public API to read or open that scope, so this one function reaches into
    ``keras.src``."""
    from keras.src.backend.common.variables import AutocastScope, get_autocast_scope

    dtype = getattr(get_autocast_scope(), "dtype", None)
    return (lambda: AutocastScope(dtype)) if dtype else contextlib.nullcontext


class Stage3Units:
    """The model's layers wrapped to gather their variables from ``shard`` (see the module
    docstring); ``wire``: Horovod's compression of the reduce-scatter; ``slices``: this rank's
    slice of each variable from :func:`build_in_slices` (whose empty variables the model has),
    which :meth:`start` puts in the shard."""

    def __init__(self, model: keras.Model, shard: UnitShard, prefetch: int, reshard: bool,
                 wire: Any, slices: list[np.ndarray]) -> None:
        self.model, self.shard = model, shard
        self.prefetch, self.reshard, self.wire = prefetch, reshard, wire
        self.variables = shard.variables
        self._slices: list[np.ndarray] | None = slices
        self._inputs: dict[int, tf.Tensor] = {}  # the current trace's unit inputs, by unit
        self._douts: dict[int, tf.Tensor] = {}  # and output gradients
        self.released = True  # built in slices
        self._split: tuple[Any, list[tf.Tensor]] | None = None
        # The current trace's waits for gathers and its units' weight gradients' clocks.
        self._clocks: tuple[Any, list[tf.Tensor], list[tf.Tensor]] | None = None
        k = 0
        for layer, unit in zip(_unit_layers(model, shard), shard.units, strict=True):
            layer.call = self._wrapped(k, layer.call, unit)
            k += 1
        self.count = k

    def _gather(self, unit: Sequence[int], pieces: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """The unit's variables whole, each in its shape (a collective)."""
        flats = hvd.grouped_allgather(list(pieces), process_set=self.shard.process_set)
        return [tf.reshape(f, self.variables[i].shape) for f, i in zip(flats, unit, strict=True)]

    def _after(self, held: dict[int, tf.Tensor], k: int) -> list[tf.Tensor]:
        """The control dependency of a gather: unit ``k``'s tensor in ``held`` if this trace
        recorded one."""
        found = held.get(k)
        graph = tf.compat.v1.get_default_graph()
        return [found] if found is not None and getattr(found, "graph", None) is graph else []

    def _wrapped(self, k: int, call: Callable[..., Any], unit: list[int]) -> Callable[..., Any]:
        """``call`` of unit ``k`` (variables ``unit``) gathering its variables around it."""
        mapped = [self.variables[i] for i in unit]

        def run(x: tf.Tensor, full: Sequence[tf.Tensor], kwargs: dict[str, Any],
                autocast: Callable[[], Any]) -> Any:
            # The layer's autocast, which Layer.__call__ sets around the forward only, also
            # around the backward's run.
            with autocast(), \
                    keras.StatelessScope(state_mapping=list(zip(mapped, full, strict=True))):
                return call(x, **kwargs)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if len(args) != 1 or not isinstance(args[0], tf.Tensor):
                raise HvdtrainError("shard.stage=3 with framework='tensorflow': each of "
                                    "model.layers must take one tensor; use shard.stage=2")
            split = self.split()
            pieces = [split[i] for i in unit]
            float_input = args[0].dtype.is_floating
            cast = _autocast_now()

            @tf.custom_gradient
            def forward(x: tf.Tensor, *mine: tf.Tensor) -> Any:
                self._inputs[k] = x
                with tf.control_dependencies(self._after(self._inputs, max(0, k - self.prefetch))):
                    full = self._gather(unit, [tf.identity(p) for p in mine])
                self._note_wait(x, full)
                y = run(x, full, kwargs, cast)

                def backward(dy: tf.Tensor) -> list[Any]:
                    self._douts[k] = dy
                    later = min(self.count - 1, k + self.prefetch)
                    again = full
                    if self.reshard:  # gathered again: the forward's copies died after it
                        with tf.control_dependencies(self._after(self._douts, later)):
                            again = self._gather(unit, [tf.identity(p) for p in mine])
                        self._note_wait(dy, again)
                    with tf.GradientTape() as tape:
                        tape.watch(again)
                        if float_input:
                            tape.watch(x)
                        y2 = run(x, again, kwargs, cast)
                    grads = tape.gradient(y2, [x, *again], output_gradients=dy,
                                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
                    flats = [tf.reshape(g, [-1]) for g in grads[1:]]
                    with tf.control_dependencies(flats):
                        self._trace_clocks()[2].append(tf.timestamp())
                    scattered = grouped_reducescatter(flats, op=hvd.Average,
                                                      compression=self.wire,
                                                      process_set=self.shard.process_set)
                    return [grads[0] if float_input else None, *scattered]

                return y, backward

            return forward(args[0], *pieces)

        return wrapped

    def split(self) -> list[tf.Tensor]:
        """The shard variable cut into each variable's slice, once per traced function: the
        gradient of a split is one concatenation, where each slice of the variable would have
        its own gradient the size of the whole shard."""
        graph = tf.compat.v1.get_default_graph()
        if self._split is None or self._split[0] is not graph:
            self._split = (graph, tf.split(tf.convert_to_tensor(self.shard.var.value),
                                           self.shard.owns))
        return self._split[1]

    def _trace_clocks(self) -> tuple[Any, list[tf.Tensor], list[tf.Tensor]]:
        """This trace's gather waits and the clocks read after each unit's weight gradient."""
        graph = tf.compat.v1.get_default_graph()
        if self._clocks is None or self._clocks[0] is not graph:
            self._clocks = (graph, [], [])
        return self._clocks

    def _note_wait(self, needed: tf.Tensor, gathered: Sequence[tf.Tensor]) -> None:
        """Records the seconds from ``needed`` (a unit's input or output gradient) being there
        to the unit's ``gathered`` variables being there (0 where they came first): what the
        computation waited for the gather."""
        with tf.control_dependencies([needed]):
            ready = tf.timestamp()
        with tf.control_dependencies(list(gathered)):
            done = tf.timestamp()
        self._trace_clocks()[1].append(tf.maximum(done - ready, 0.0))

    def waited(self, scattered: tf.Tensor) -> tf.Tensor:
        """Inside a traced pass, after its gradients: the seconds it waited for collectives,
        float64 (see the module docstring); ``scattered``: the shard's gradient, which the last
        reduce-scatter completes."""
        _, waits, computed = self._trace_clocks()
        total = tf.add_n(waits) if waits else tf.constant(0.0, tf.float64)
        if computed:
            with tf.control_dependencies([scattered]):
                done = tf.timestamp()
            total += tf.maximum(done - tf.reduce_max(tf.stack(computed)), 0.0)
        self._clocks = None
        return total

    def start(self) -> None:
        """The shard's values at the start of a run (a collective): each variable's slice as
        built, or, where rank 0 restored the model whole from a checkpoint, broadcast from it a
        variable at a time (each rank keeping its slice); neither after the first start (the
        shard is the current state). The model's variables are empty afterwards."""
        whole = hvd.broadcast_object(
            self.shard.rank == 0 and any(int(tf.size(v.value)) > 0 for v in self.variables),
            root_rank=0, name="hvdtrain.shard3.restored")
        pieces = self._slices
        if whole:
            pieces = []
            for i, v in enumerate(self.variables):
                value = v.value if self.shard.rank == 0 else tf.zeros(v.shape, v.dtype)
                got = hvd.broadcast(tf.convert_to_tensor(value), root_rank=0,
                                    name=f"hvdtrain.shard3.model.{i}")
                lo, hi = self.shard.bounds[i]
                pieces.append(tf.reshape(got, [-1])[lo:hi].numpy())
                v.value.assign(tf.zeros([0], v.dtype))  # one variable whole at a time
        if pieces is not None:
            self.shard.var.assign(np.concatenate(pieces) if pieces else
                                  np.zeros(0, np.float32))
        self._slices = None
        self.release()

    def release(self) -> None:
        """Empties the model's variables: the rank keeps its slices (in the shard variable)
        only. Their storage (:func:`build_in_slices`) is a variable of any shape; Keras still
        reports each one's shape."""
        for v in self.variables:
            v.value.assign(tf.zeros([0], v.dtype))
        self.released = True

    def materialise(self) -> None:
        """Every variable whole again from the ranks' slices (a collective); :meth:`release`
        empties them again."""
        if self.released:
            self.shard.store()
            self.released = False


def _unit_layers(model: keras.Model, shard: UnitShard) -> list[Any]:
    """The layer of each of ``shard``'s units."""
    layers = []
    for unit in shard.units:
        k = _owner(model.layers, shard.variables[unit[0]])
        assert k is not None  # check_model
        layers.append(model.layers[k])
    return layers


def gather_model(shard: UnitShard, keep: bool) -> list[np.ndarray]:
    """Every trainable variable whole, gathered one group at a time (a collective); kept (as
    arrays) where ``keep``, else dropped as soon as gathered."""
    whole: list[np.ndarray] = []
    mine = shard.var.value
    for g, group in enumerate(shard._group_vars):
        pieces = [mine[shard.starts[i]:shard.starts[i] + shard.owns[i]] for i in group]
        got = hvd.grouped_allgather(pieces, name=f"hvdtrain.shard3.model.{g}")
        if keep:
            whole += [f.numpy().reshape(shard.variables[i].shape)
                      for f, i in zip(got, group, strict=True)]
    return whole


def make_stage3(model: keras.Model, variables: Sequence[Any], rank: int, size: int,
                unit_kib: int) -> UnitShard:
    """Stage 2's shard of ``variables`` by layer, after checking the model fits stage 3."""
    check_model(model)
    return UnitShard(variables, layer_units(model.layers, variables), rank, size,
                     unit_kib * 256)


class Stage3Exchange(UnitExchange):
    """Stage 2's exchange with stage 3's bytes: per micro-batch the whole gradient once (its
    reduce-scatter) and the rank's float32 slices once per gather (two with
    ``shard.reshard_after_forward``, one without)."""

    def __init__(self, shard: UnitShard, compression: str, accumulation: int,
                 gathers: int) -> None:
        super().__init__(shard, compression, accumulation)
        item = 2 if compression == "fp16" else 4
        self._bytes = (float((item * shard.total + 4 * shard.own * gathers) * accumulation),
                       float((4 * shard.total + 4 * shard.own * gathers) * accumulation))


class Stage3Kernels(UnitKernels):
    """Stage 2's kernels where the gradient of the shard variable comes out of the tape already
    reduce-scattered (each unit's backward does it) and nothing is gathered after the step."""

    def __init__(self, *args: Any, units: Stage3Units, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.units = units
        # The step's wait for collectives so far: micro-batches before the last add theirs.
        self.waited = tf.Variable(tf.constant(0.0, tf.float64), trainable=False)

    def _shard_gradients(self, x: tf.Tensor, y: tf.Tensor, scale: tf.Tensor
                         ) -> tuple[tf.Tensor, dict, tf.Tensor]:
        with tf.GradientTape() as tape:
            pieces = self.units.split()  # what the units' forward passes take their slices from
            loss_sum, metrics = self.adapter.loss_and_metrics(self.model, x, y, training=True)
            target = self.precision.scale(self.optimizer, loss_sum * scale)
        grads = tape.gradient(target, pieces, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        mine = tf.concat(grads, 0)
        self.waited.assign_add(self.units.waited(mine))
        return loss_sum, metrics, mine

    def _fused_step(self, x: tf.Tensor, y: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
        """The last micro-batch and the shard's update: its loss sum and metrics, and the
        seconds the step's passes waited for their gathers and reduce-scatters
        (:meth:`Stage3Units.waited`)."""
        loss_sum, metrics, grads = self._gradients(x, y, scale)
        self._metric_keys = sorted(metrics)
        self._step(grads)
        comm_s = self.waited.read_value()  # ordered after the passes' adds, before the reset
        self.waited.assign(tf.zeros_like(comm_s))
        values = [loss_sum, *(metrics[k] for k in self._metric_keys), comm_s]
        return tf.stack([tf.cast(v, tf.float64) for v in values])

    def _apply(self, grads: list[tf.Tensor]) -> None:
        self._step(grads)
