"""Sharded data parallel at stage 1 for PyTorch (``shard.stage=1``): the sharded update.

Every rank of a stage's data-parallel copies owns 1/N of the flat parameters
(:mod:`hvdtrain.shard` says which; the copies come from :class:`hvdtrain.layout.Layout`): a step
reduce-scatters the flat gradient with Horovod's ``Average`` (:class:`ShardedExchange`), each
rank's optimizer steps its own shard only, so its optimizer state covers 1/N of the model, and
the updated shards are allgathered back into every rank's parameters (:class:`ShardedOptimizer`).
Both collectives run in rounds of at most ``shard.chunk_kib`` per rank, so that neither Horovod nor
this module holds a second copy of the whole gradient (Horovod's Gloo reduce-scatter copies its
input); the gradients themselves live in one flat buffer, and so do the parameters, whose own
range is the shard the optimizer steps in place. That is ZeRO stage 1's memory saving;
the arithmetic is the ring's (an average, then the same element-wise update), so a sharded run
trains as a ring run of the same ranks.

Checkpoints: every rank writes its own shard (:mod:`hvdtrain.torch.shard_files`). A state in the
whole model's layout, the one Horovod's ``DistributedOptimizer`` writes on the ring (a ring
checkpoint, or a sharded one written before), is cut into the shards of the current world on
restore (:func:`broadcast_shards`); :meth:`ShardedOptimizer.gather` still collects that layout
onto rank 0 for a caller of ``state_dict``.
"""

from __future__ import annotations

import inspect
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import torch

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
from hvdtrain.torch.collectives import any_rank

_WIRE = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}

Targets = Callable[[int], torch.Tensor | None]
"""Parameter index -> the flat tensor a gathered piece is written into (None: dropped)."""


def same_optimizer(optimizer: torch.optim.Optimizer,
                   params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and settings over ``params`` (defaults its
    constructor does not take are left out: AdamW's ``decoupled_weight_decay``)."""
    takes = inspect.signature(type(optimizer).__init__).parameters
    return type(optimizer)(params, **{k: v for k, v in optimizer.defaults.items() if k in takes})


def sharded(value: Any) -> bool:
    """Whether an optimizer state entry is per element (sharded) rather than per parameter (a
    0-dim ``step``, a None buffer: copied whole)."""
    return torch.is_tensor(value) and value.dim() > 0


@dataclass(frozen=True)
class _Whole:
    """Stands for a per-element tensor in a state's outline: what a rank allocates to receive it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _outline(full: Mapping[str, Any]) -> dict[str, Any]:
    """``full`` with its per-element tensors replaced by their shapes and dtypes."""
    return {"param_groups": full["param_groups"],
            "state": {index: {key: _Whole(tuple(v.shape), v.dtype) if sharded(v) else v
                              for key, v in entry.items()}
                      for index, entry in full["state"].items()}}


class ShardedOptimizer(torch.optim.Optimizer):
    """The run's optimizer, stepping this rank's shard of the flat parameters only.

    It stands where the run's optimizer stood for the step (``param_groups`` for the learning
    rate and the precision, ``zero_grad``, ``step``) and for checkpoints (``state_dict`` and
    ``load_state_dict`` in the whole model's layout). Its ``step`` writes the updated shard
    back into every rank's parameters (a collective). The update itself is an optimizer of the
    run's class and settings over the shard alone (``inner``), whose groups and state these are.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, rank: int,
                 size: int, chunk: int, process_set: Any = None, replicas: Any = None) -> None:
        # The ranks sharing the model: every rank, or a pipeline stage's copies (their set).
        self.process_set = hvd.global_process_set if process_set is None else process_set
        # shard.group=node: the ranks holding this shard on the other nodes (None: none).
        self.replicas = replicas
        # The rank that writes keeps the gathered state: the first of its set (on the first node).
        self.keeper = rank == 0 and (replicas is None or replicas.rank() == 0)
        every = list(model.parameters())
        self.params = [p for p in every if p.requires_grad]
        self.indices = [i for i, p in enumerate(every) if p.requires_grad]
        self.count = len(every)  # the ring's param_groups name every parameter
        for p in self.params:
            if p.dtype != torch.float32 or not p.is_contiguous():
                raise HvdtrainError("shard.stage=1: every trainable parameter must be "
                                    "a contiguous float32 tensor")
        self.sizes = [p.numel() for p in self.params]
        self.total, self.rank, self.size, self.chunk = sum(self.sizes), rank, size, chunk
        self.start, self.stop = shard_bounds(self.total, size, rank)
        device = self.params[0].device if self.params else torch.device("cpu")
        # The gradients live in one flat buffer (as DDP's gradient_as_bucket_view): backward
        # accumulates into these views in place, and the reduce-scatter sends the buffer itself
        # rather than a concatenated copy of the whole gradient.
        self.flat_grad = torch.zeros(self.total, device=device)
        bounds = [0, *itertools.accumulate(self.sizes)]
        self.grad_views = [self.flat_grad[a:b].view(p.shape)
                           for a, b, p in zip(bounds, bounds[1:], self.params, strict=False)]
        # The parameters become views of one flat buffer (as stages 2-3's units' are), so that
        # the shard the optimizer steps is their own range of it, updated in place, rather than
        # a float32 copy beside them (4/N bytes a parameter at the update's peak).
        self.flat_param = flatten_into_one(self.params, device)
        self.shard = torch.nn.Parameter(self.flat_param[self.start:self.stop])
        super().__init__([self.shard], dict(optimizer.defaults))
        # The same class and settings as the run's optimizer, over the shard alone.
        self.inner = same_optimizer(optimizer, [self.shard])
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        self.stats: dict[str, float] = {"comm_s": 0.0}  # the exchange's: the allgather adds
        self._full: dict[str, Any] | None = None  # rank 0: the state gathered or restored

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the model's gradients (they accumulate over micro-batches) in the flat buffer
        and clears the shard's."""
        self.flat_grad.zero_()
        for p, view in zip(self.params, self.grad_views, strict=True):
            p.grad = view
        self.shard.grad = None

    def flat_gradient(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """``grads`` as one flat float32 vector: the buffer itself where they are its views (as
        :meth:`zero_grad` left them), else a concatenated copy."""
        if all(g.data_ptr() == v.data_ptr() for g, v in zip(grads, self.grad_views, strict=True)):
            return self.flat_grad
        return torch.cat([g.detach().reshape(-1).to(torch.float32) for g in grads])

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Steps the shard (its gradient set from the exchange), then allgathers every shard back
        into the parameters (a collective)."""
        self._load_shard()
        self._step_in_pieces()
        began = time.perf_counter()
        flat = [p.view(-1) for p in self.params]
        self.allgather(self.shard.detach(), flat.__getitem__, "params")
        self.stats["comm_s"] += time.perf_counter() - began

    def _step_in_pieces(self) -> None:
        # The inner optimizer over pieces of at most `chunk` elements of the shard, one after
        # another: torch's CPU Adam makes temporaries the size of the tensor it steps (a square
        # root, a quotient), which over the whole shard held 2 x its size at the step's peak.
        # The update is element-wise, so the pieces give the whole step's values.
        step_in_pieces(self.inner, self.shard, self.chunk)

    def grad_norm(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """The global L2 norm of the step's gradient from this rank's shards of it (an
        allreduce of the sum of squares over the ranks sharing the model)."""
        local = torch.zeros((), dtype=torch.float64)
        for g in grads:
            local += g.detach().double().pow(2).sum()
        return hvd.allreduce(local, op=hvd.Sum, name="hvdtrain.shard.norm",
                             process_set=self.process_set).sqrt().float()

    def overflowed(self, grads: Sequence[torch.Tensor]) -> bool:
        """fp16: whether the step's scaled gradient holds an inf or a NaN in any rank's shard (one
        allreduce of a flag over every rank). The ring's loss scaler sees the whole average; so
        here every rank skips the step and lowers the scale, or none does."""
        return any_rank(not all(bool(torch.isfinite(g).all()) for g in grads))

    def _load_shard(self) -> None:
        # The shard is the parameters' own range already, unless something replaced a
        # parameter's data since (then from the parameters: a restore of the model reaches it).
        if self._aliased():
            return
        for seg in segments(self.sizes, self.start, self.stop):
            src = self.params[seg.param].view(-1)[seg.offset:seg.offset + seg.length]
            self.shard.data[seg.flat - self.start:seg.flat - self.start + seg.length] = src

    def _aliased(self) -> bool:
        """Whether every parameter is still its view of the flat buffer and the shard its range."""
        at = self.flat_param.data_ptr() + self.start * self.flat_param.element_size()
        if self.shard.data_ptr() != at:
            return False
        offset = 0
        for p, n in zip(self.params, self.sizes, strict=True):
            if p.data_ptr() != self.flat_param[offset:offset + n].data_ptr():
                return False
            offset += n
        return True

    def allgather(self, shard: torch.Tensor, targets: Targets, tag: str) -> None:
        """Every rank's ``shard`` (a per-element tensor of this rank's shard) written into
        ``targets`` by parameter, in :func:`~hvdtrain.shard.pieces` rounds of at most
        ``chunk`` elements per rank (a collective)."""
        for k in range(pieces(self.total, self.size, self.chunk)):
            ranges = round_ranges(self.total, self.size, self.chunk, k)
            a, b = ranges[self.rank]
            got = hvd.allgather(shard[a - self.start:b - self.start].contiguous(),
                                name=f"hvdtrain.shard.{tag}.{k}", process_set=self.process_set)
            at = 0
            for lo, hi in ranges:
                self._write(got[at:at + hi - lo], lo, hi, targets)
                at += hi - lo

    def reducescatter(self, flat: torch.Tensor, wire: Any) -> torch.Tensor:
        """The average over the ranks of this rank's shard of ``flat`` (the whole flat gradient),
        in the same rounds as :meth:`allgather`, then over its replicas on the other nodes
        (shard.group=node: :func:`across_nodes`) (a collective). The average is written over
        the rank's own range of ``flat`` and returned as a view of it."""
        for k in range(pieces(self.total, self.size, self.chunk)):
            ranges = round_ranges(self.total, self.size, self.chunk, k)
            send = torch.cat([flat[lo:hi] for lo, hi in ranges])
            got = hvd.reducescatter(send, name=f"hvdtrain.shard.grads.{k}", op=hvd.Average,
                                    compression=wire, process_set=self.process_set)
            # Into the rank's own range of `flat`, which later rounds no longer read: the
            # shard's gradient needs no buffer of its own beside the whole one.
            a, b = ranges[self.rank]
            flat[a:b] = got
        mine = flat[self.start:self.stop]
        return across_nodes([mine], self.replicas, wire, "hvdtrain.shard.cross")[0]

    def _write(self, piece: torch.Tensor, lo: int, hi: int, targets: Targets) -> None:
        for seg in segments(self.sizes, lo, hi):
            target = targets(seg.param)
            if target is not None:
                target[seg.offset:seg.offset + seg.length] = piece[seg.flat - lo:
                                                                   seg.flat - lo + seg.length]

    # checkpoints: the whole model's layout ----------------------------------------------------

    def gather(self) -> None:
        """Collects every shard's optimizer state onto rank 0 in the whole model's layout, for
        :meth:`state_dict` (a collective)."""
        own = self.inner.state_dict()
        entry = own["state"].get(0, {})
        state: dict[int, dict[str, Any]] = {i: {} for i in self.indices}
        for key in sorted(entry):
            value = entry[key]
            if not sharded(value):
                for i in self.indices:
                    state[i][key] = value.clone() if torch.is_tensor(value) else value
                continue
            # Only rank 0 keeps the whole state; the others pass their shard on and drop the rest.
            full = [torch.zeros(n, dtype=value.dtype) for n in self.sizes] if self.keeper else []
            kept: Targets = full.__getitem__ if self.keeper else (lambda _: None)
            self.allgather(value.detach(), kept, f"state.{key}")
            for i, p, flat in zip(self.indices, self.params, full, strict=False):
                state[i][key] = flat.reshape(p.shape)
        groups = [{**group, "params": list(range(self.count))} for group in own["param_groups"]]
        self._full = ({"state": state if entry else {}, "param_groups": groups}
                      if self.keeper else None)

    def state_dict(self) -> dict[str, Any]:
        """The state :meth:`gather` collected (rank 0), in the ring's layout."""
        if self._full is None:
            raise HvdtrainError("shard.stage=1: the optimizer state is written after "
                                "gather() only, on rank 0")
        full, self._full = self._full, None
        return full

    def load_state_dict(self, full: Mapping[str, Any]) -> None:
        """Takes this rank's shard of a state in the whole model's layout (written by the ring,
        or by the sharded update at any number of ranks); kept for :meth:`broadcast`."""
        self._full = dict(full)
        self._apply(full)

    def broadcast(self, root_rank: int = 0) -> None:
        """Gives every rank its shard of the state rank ``root_rank`` restored (a collective; a
        fresh start makes the state instead, see :meth:`_zero_step`). The per-element tensors
        travel one at a time, so no rank ever holds more than one parameter's of them whole."""
        broadcast_shards(self, root_rank)

    def _zero_step(self) -> None:
        # As Horovod's broadcast_optimizer_state on the ring: a fresh optimizer makes its state
        # with one zero-gradient step, which changes the weights too where weight decay or Adam's
        # momentum acts (the ring then broadcasts rank 0's changed weights). Done the same way,
        # a sharded run trains as the ring's (Adam's step count starts at 1 in both).
        self.shard.grad = torch.zeros_like(self.shard)
        self.step()
        self.shard.grad = None

    def _apply(self, full: Mapping[str, Any],
               fetch: Callable[[int, str, Any], torch.Tensor] | None = None) -> None:
        """Loads this rank's shard of ``full`` (the whole model's layout) into the shard's
        optimizer; ``fetch`` gives each per-element tensor whole where ``full`` holds only its
        outline (:meth:`broadcast`), one parameter's at a time."""
        groups = full["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != self.count:
            raise HvdtrainError(f"the optimizer state has {len(groups)} group(s) of "
                                f"{[len(g['params']) for g in groups]} parameters; this model "
                                f"has one group of {self.count}")
        own: dict[str, Any] = {}
        for j, index in enumerate(self.indices):
            for key, value in full["state"].get(index, {}).items():
                if not (sharded(value) or isinstance(value, _Whole)):
                    own.setdefault(key, value)  # the same for every parameter: the first's
                    continue
                tensor = fetch(index, key, value) if fetch else value
                part = own.setdefault(key, torch.zeros(self.stop - self.start, dtype=tensor.dtype))
                self._put(part, j, tensor)
        self.inner.load_state_dict({"state": {0: own} if own else {},
                                    "param_groups": [{**groups[0], "params": [0]}]})
        # Torch's load replaces the groups and the state: this optimizer must show the new ones.
        self.param_groups, self.state = self.inner.param_groups, self.inner.state

    def _put(self, part: torch.Tensor, param: int, tensor: torch.Tensor) -> None:
        """Copies the elements of parameter ``param``'s ``tensor`` that this shard owns into
        ``part`` (a per-element tensor of the shard)."""
        for seg in segments(self.sizes, self.start, self.stop):
            if seg.param == param:
                src = tensor.reshape(-1)[seg.offset:seg.offset + seg.length]
                part[seg.flat - self.start:seg.flat - self.start + seg.length] = src


def flatten_into_one(params: Sequence[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    """One flat float32 buffer holding ``params``' values, each parameter made a view of its
    range (its own storage freed as the next is copied: never a second whole model)."""
    flat = torch.empty(sum(p.numel() for p in params), device=device)
    at = 0
    for p in params:
        n = p.numel()
        flat[at:at + n].copy_(p.detach().reshape(-1))
        p.data = flat[at:at + n].view(p.shape)
        at += n
    return flat


def step_in_pieces(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter,
                   piece: int) -> None:
    """``optimizer.step()`` for its one flat parameter ``param`` (the shard), over pieces of at
    most ``piece`` elements in turn, so that the optimizer's temporaries are the size of a
    piece. Each piece sees the per-element state (Adam's moments, momentum) as views of the
    whole and the per-parameter entries (Adam's step count) as they were before the step; an
    element-wise optimizer gives the very values of one step over the whole."""
    whole, grad = param.data, param.grad
    total = whole.numel()
    if grad is None or total <= piece:
        optimizer.step()
        return
    before = dict(optimizer.state.get(param, {}))
    made: dict[str, torch.Tensor] = {}  # a fresh optimizer's per-element state, whole
    after: dict[str, Any] = {}
    try:
        for a in range(0, total, piece):
            b = min(a + piece, total)
            param.grad = None  # before .data: the shapes of the two must agree
            param.data = whole[a:b]
            param.grad = grad[a:b]
            optimizer.state[param] = {k: v[a:b] if sharded(v) else _fresh(v)
                                      for k, v in before.items()}
            optimizer.step()
            after = optimizer.state[param]
            for key, value in after.items():
                if sharded(value) and key not in before:
                    made.setdefault(key, torch.empty(total, dtype=value.dtype,
                                                     device=value.device))[a:b] = value
    finally:
        param.grad = None
        param.data = whole
        param.grad = grad
    optimizer.state[param] = {k: before[k] if sharded(before.get(k)) else made.get(k, v)
                              for k, v in after.items()}


def _fresh(value: Any) -> Any:
    """A per-parameter state entry as each piece must see it: a copy of its value before the
    step (Adam's step count, which each piece's step advances in place)."""
    return value.clone() if torch.is_tensor(value) else value


class ShardedExchange(GradientExchange):
    """Horovod's ``reducescatter`` of the flat gradient, in rounds: each rank gets the average of
    its own shard, which :class:`ShardedOptimizer` steps and allgathers back. ``wire_bytes``
    counts what a rank hands Horovod a step: the whole gradient (float16 under ``fp16``) and its
    float32 shard; ``dense_bytes`` the same in float32."""

    def __init__(self, optimizer: ShardedOptimizer, compression: str) -> None:
        self.optimizer, self.rank, self.size = optimizer, optimizer.rank, optimizer.size
        self.job = (hvd.rank(), hvd.size())  # the job's rank and size, beside the shard's place
        self.wire = _WIRE[compression]
        own = optimizer.stop - optimizer.start
        self._bytes = step_bytes(optimizer.total, own, compression)
        # shard.group=node: the shard's allreduce across nodes comes on top, and is all that
        # leaves a node (the reduce-scatter and the all-gather stay within it).
        self._cross = cross_bytes(own, compression) if optimizer.replicas is not None else None
        self.stats = {"wire_bytes": 0.0, "dense_bytes": 0.0, "comm_s": 0.0, "compress_s": 0.0}

    def run(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        began = time.perf_counter()
        flat = self.optimizer.flat_gradient(grads)
        mine = self.optimizer.reducescatter(flat, self.wire)
        wire, dense = self._bytes
        # Shared with the optimizer, whose allgather adds its wait before the step reads them.
        self.stats = {"wire_bytes": wire, "dense_bytes": dense, "compress_s": 0.0,
                      "comm_s": time.perf_counter() - began}
        if self._cross is not None:
            self.stats = with_cross(self.stats, *self._cross)
        self.optimizer.stats = self.stats
        return [mine]

    def any_rank(self, flag: bool) -> bool:
        # shard.group=node: every node decides (the node's set would leave the others out).
        whole = self.optimizer.replicas is not None
        return any_rank(flag, None if whole else self.optimizer.process_set)

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        check_resize(*self.job, rank, size)

    def gather(self) -> None:
        self.optimizer.gather()

    def broadcast(self, root_rank: int = 0) -> None:
        self.optimizer.broadcast(root_rank)


def make_sharded(optimizer: torch.optim.Optimizer, model: torch.nn.Module, rank: int,
                 size: int, chunk: int, compression: str, process_set: Any = None,
                 replicas: Any = None) -> tuple[GradientExchange, torch.optim.Optimizer]:
    """Stage 1's exchange and the sharded optimizer standing for ``optimizer`` (whose class and
    settings it keeps); ``chunk``: elements per rank in one round of either collective;
    ``process_set``: Horovod's set of the ``size`` ranks that share the model (None: every rank;
    a pipeline stage's copies; a node's ranks under shard.group=node, then ``replicas`` is the
    set of the ranks holding the same shard on the other nodes). Stages 2 and 3 are
    :mod:`hvdtrain.torch.shard_units`'s, which builds on this module."""
    # The rounds' buffers and the update's pieces come and go every step: without this, glibc
    # keeps them in its heap once its threshold has risen (hvdtrain/malloc.py), as at stages 2-3.
    return_freed_blocks()
    sharded_opt = ShardedOptimizer(optimizer, model, rank, size, chunk, process_set, replicas)
    return ShardedExchange(sharded_opt, compression), sharded_opt


def across_nodes(shards: list[torch.Tensor], replicas: Any, wire: Any,
                 name: str) -> list[torch.Tensor]:
    """shard.group=node: each of this rank's averaged ``shards`` (averaged over its node)
    averaged again over ``replicas``, the ranks holding the same shards on the other nodes (one
    grouped allreduce, ``wire``: Horovod's compression). The average of the nodes' averages is
    the ring's over every rank, the nodes holding as many ranks. ``shards`` as they are where
    ``replicas`` is None (the shards span every rank)."""
    if replicas is None or not shards:
        return shards
    return list(hvd.grouped_allreduce(shards, name=name, op=hvd.Average, compression=wire,
                                      process_set=replicas))


def cross_bytes(own: int, compression: str) -> tuple[float, float]:
    """``(wire, dense)`` bytes of a rank's allreduce of its ``own`` shard's gradient across the
    nodes (shard.group=node): float16 under ``fp16``, float32 otherwise."""
    return float((2 if compression == "fp16" else 4) * own), float(4 * own)


def with_cross(stats: dict[str, float], wire: float, dense: float) -> dict[str, float]:
    """``stats`` with the allreduce across nodes added to the bytes, and reported apart as
    ``cross_node_bytes`` (what leaves the node)."""
    return {**stats, "wire_bytes": stats["wire_bytes"] + wire,
            "dense_bytes": stats["dense_bytes"] + dense, "cross_node_bytes": wire}


def broadcast_shards(opt: Any, root_rank: int) -> None:
    """Gives every rank its shards of the state that ``opt`` (a sharded optimizer of stage 1 or
    of :mod:`hvdtrain.torch.shard_units`) restored on rank ``root_rank`` (the job's rank, as
    Horovod names a root in a process set too), one parameter's tensor at a time; with nothing
    restored, a fresh optimizer makes its state by ``opt._zero_step``."""
    full = opt._full if hvd.rank() == root_rank else None
    opt._full = None
    group = getattr(opt, "process_set", hvd.global_process_set)  # stage 1's may be a stage's
    if getattr(opt, "replicas", None) is not None:  # shard.group=node: the other nodes too
        group = hvd.global_process_set
    outline = hvd.broadcast_object(None if full is None else _outline(full),
                                   root_rank=root_rank, name="hvdtrain.shard.outline",
                                   process_set=group)
    if outline is None:
        # Restored from a checkpoint of shards (hvdtrain/torch/shard_files.py): it has a state.
        if not opt.inner.state and not getattr(opt, "restored_shards", False):
            opt._zero_step()
        return

    def fetch(index: int, key: str, value: _Whole) -> torch.Tensor:
        mine = (full["state"][index][key] if full is not None
                else torch.empty(value.shape, dtype=value.dtype))
        return hvd.broadcast(mine, root_rank, name=f"hvdtrain.shard.{index}.{key}",
                             process_set=group)

    opt._apply(outline, fetch)
