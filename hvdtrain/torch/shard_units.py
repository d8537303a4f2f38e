"""Sharded data parallel at stages 2 and 3 for PyTorch (``shard.stage`` 2 or 3, docs/sharding.md).

The model is cut into units (:func:`find_units`: the layers of a ``Sequential``, else modules
of at most ``shard.unit_kib``; parameters in no unit form a last, root unit). Each unit's
trainable parameters, flattened in order, are split over the data-parallel copies as Horovod
splits a first dimension (:func:`hvdtrain.shard.shard_bounds`): each rank keeps a float32 shard
of every unit, which its optimizer (the run's class and settings) steps.

- **Stage 2** keeps the parameters whole on every rank. As the backward pass finishes a unit's
  gradients (a post-accumulate-grad hook on each parameter), the unit's flat gradient is
  reduce-scattered with Horovod's ``Average`` (asynchronously: the backward pass goes on) and
  the whole gradients are dropped; each rank keeps the gradient of its shards only, summed over
  the micro-batches. After the update the shards are all-gathered back into the parameters.
- **Stage 3** keeps the shards only. A unit's parameters are all-gathered before its forward
  pass (a forward pre-hook) and, when ``shard.reshard_after_forward``, freed after it and
  gathered again before its backward pass (a backward pre-hook); the gathers of the next
  ``shard.prefetch`` units start ahead (Horovod's async handles). After the unit's backward pass
  the gathered parameters are freed, then its gradient is made flat and reduce-scattered. The
  parameters stay
  sharded after training; :meth:`UnitSharding.gather_all` makes them whole (a collective).

Checkpoints: every rank writes its own shards (:mod:`hvdtrain.torch.shard_files`), so a run
resumes at another stage or number of ranks. A state in the ring's layout (a ring checkpoint, or
a sharded one written before) is cut into the current world's shards on restore, as at stage 1
(:mod:`hvdtrain.torch.shard`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import horovod.torch as hvd
import torch
from torch import nn

from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import GradientExchange
from hvdtrain.shard import check_resize
from hvdtrain.torch.collectives import any_rank, start_allgather, start_reducescatter
from hvdtrain.torch.shard import (
    _Whole,
    across_nodes,
    broadcast_shards,
    cross_bytes,
    same_optimizer,
    sharded,
    with_cross,
)
from hvdtrain.torch.units import UNIT, Unit, build_by_units, checkpoint_units, find_units

__all__ = ["UnitShardedExchange", "UnitShardedOptimizer", "UnitSharding", "build_by_units",
           "checkpoint_units", "make_unit_sharded"]

# A first unit whose inputs need no gradient (token ids) still gets its backward pre-hook, which
# is all stage 3 asks of it.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are "
                        "computed with respect to module outputs")


class UnitSharding:
    """The hooks and collectives of stages 2 and 3 over the model's units (module docstring)."""

    piece_kib = 0
    """``shard.piece_kib``: each unit's all-gathers and reduce-scatters in rounds of at most this
    many KiB per rank (0: one collective a unit); set by :func:`make_unit_sharded`."""

    def __init__(self, model: nn.Module, stage: int, rank: int, size: int, unit_bytes: int,
                 prefetch: int, reshard_after_forward: bool, compression: str,
                 group: Any = None, replicas: Any = None, root: int | None = 0) -> None:
        self.stage, self.rank, self.size, self.prefetch = stage, rank, size, prefetch
        # The ranks sharing the model (None: every rank; shard.group=node: the node's) and, under
        # shard.group=node, the ranks holding the same shards on the other nodes.
        self.group = hvd.global_process_set if group is None else group
        self.replicas = replicas
        # The rank that writes keeps what is gathered for a checkpoint (the first node's first).
        self.keeper = rank == 0 and (replicas is None or replicas.rank() == 0)
        self.reshard = reshard_after_forward
        self.half = compression == "fp16"
        every = list(model.parameters())
        self.index = {id(p): i for i, p in enumerate(every)}
        self.count = len(every)
        # Every rank starts from rank 0's values, as the ring's broadcast does (root None, a
        # pipeline stage's copies: the caller's values agree already).
        if stage == 3 and root is not None:
            # (those build_by_units freed were built from them on every rank already)
            hvd.broadcast_parameters({k: v for k, v in model.state_dict().items()
                                      if v.untyped_storage().size() or not v.numel()},
                                     root_rank=root)
        self.units = self._cut(model, unit_bytes)
        if stage == 2:  # the parameters stay whole: a unit's shard is their own range of its
            for unit in self.units:  # flat buffer, not a float32 copy beside them (4/N bytes)
                unit.shard.data = unit.flat[unit.start:unit.stop]
        self.unit_of = {id(p): u for u in self.units for p in u.params}
        self.whole = False  # after finish(): the parameters stay gathered, the hooks rest
        self.micro = 0
        self.in_flight: list[Unit] = []  # the units whose reduce-scatter runs, oldest first
        self.stats = {"comm_s": 0.0}  # seconds waited for collectives; the exchange's stats
        self.restored: dict[str, torch.Tensor] | None = None  # rank 0: a checkpoint's parameters
        self.saved: dict[int, torch.Tensor] | None = None  # rank 0: gathered for a checkpoint
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.popped: list[str] = []  # the keys _load_hook took from a state dict
        self._hook(model)
        if stage == 3:
            for unit in self.units:
                unit.free()

    def _cut(self, model: nn.Module, unit_bytes: int) -> list[Unit]:
        seen: set[int] = set()
        groups: list[tuple[nn.Module | None, list[nn.Parameter]]] = []
        for module in find_units(model, unit_bytes):
            own = [p for p in module.parameters() if p.requires_grad and id(p) not in seen]
            if self.stage == 3 and any(id(p) in seen for p in module.parameters()):
                raise HvdtrainError("shard.stage=3: a parameter is shared between units "
                                    f"({type(module).__name__}); use shard.stage=2")
            seen.update(id(p) for p in own)
            if own:
                groups.append((module, own))
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in seen]
        if rest:
            groups.append((None, rest))
        # A layer that build_by_units sharded whole but that is cut finer here (more than
        # unit_bytes) is gathered, cut into its units and freed, one layer at a time.
        owner = {id(sub): layer for layer in (model if isinstance(model, nn.Sequential) else ())
                 if hasattr(layer, UNIT) for sub in layer.modules()}
        units: list[Unit] = []
        opened: nn.Module | None = None
        for i, (part, params) in enumerate(groups):
            holder = owner.get(id(part))
            if holder is not opened:
                self._close(opened, units)
                opened = self._open(holder, i) if holder is not part else None
            units.append(self._unit(i, part, params))
        self._close(opened, units)
        return units

    def _open(self, layer: nn.Module | None, index: int) -> nn.Module | None:
        if layer is not None:
            built: Unit = getattr(layer, UNIT)
            built.set_full(hvd.allgather(built.shard.detach(), name=f"hvdtrain.shard.cut.{index}",
                                         process_set=self.group))
        return layer

    def _close(self, layer: nn.Module | None, units: list[Unit]) -> None:
        if layer is None:
            return
        getattr(layer, UNIT).free()  # its parameters are views of their new units' buffers now
        delattr(layer, UNIT)
        if self.stage == 3:  # and those units' gathered values go too, before the next layer's
            held = {id(p) for p in layer.parameters()}
            for unit in units:
                if unit.full and id(unit.params[0]) in held:
                    unit.free()

    def _unit(self, index: int, module: nn.Module | None, params: list[nn.Parameter]) -> Unit:
        built: Unit | None = getattr(module, UNIT, None)
        if built is None or [id(p) for p in built.params] != [id(p) for p in params]:
            return Unit(index, module, params, self.rank, self.size)
        # Sharded as it was built (build_by_units): onto the device the model was moved to.
        built.index = index
        built.shard.data = built.shard.data.to(params[0].device)
        built.grad = built.grad.to(params[0].device)
        return built

    # hooks ---------------------------------------------------------------------------------

    def _hook(self, model: nn.Module) -> None:
        for unit in self.units:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, u=unit: self._arrived(u, p))
            if self.stage == 3 and unit.module is not None:
                unit.module.register_forward_pre_hook(lambda *_, u=unit: self._before(u, 1))
                unit.module.register_forward_hook(lambda *_, u=unit: self._after_forward(u))
                unit.module.register_full_backward_pre_hook(
                    lambda *_, u=unit: self._before(u, -1))
        if self.stage == 3:
            root = [u for u in self.units if u.module is None]
            model.register_forward_pre_hook(lambda *_: self._gather_root(root))
            model.register_state_dict_post_hook(lambda *args: self._state_dict_hook(*args))
            model.register_load_state_dict_pre_hook(lambda *args: self._load_hook(*args))
            model.register_load_state_dict_post_hook(lambda *args: self._loaded(*args))

    def _gather_root(self, root: list[Unit]) -> None:
        for unit in root:  # the parameters in no unit: gathered for the whole pass
            self._gather(unit)

    def _before(self, unit: Unit, direction: int) -> None:
        """Before a unit's forward (``direction`` 1) or backward (-1) pass: its parameters, and
        the gathers of the next units in that order started."""
        if self.whole:
            return
        self._gather(unit)
        modules = [u for u in self.units if u.module is not None]
        at = modules.index(unit)
        for ahead in range(1, self.prefetch + 1):
            k = at + direction * ahead
            if 0 <= k < len(modules):
                self._start_gather(modules[k])

    def _after_forward(self, unit: Unit) -> None:
        # Under no_grad (evaluation) nothing comes back for the parameters: free them too.
        if not self.whole and (self.reshard or not torch.is_grad_enabled()):
            unit.free()

    def _start_gather(self, unit: Unit) -> None:
        if not unit.full and unit.gathering is None:
            unit.gathering = start_allgather(unit.shard.detach(),
                                             f"hvdtrain.shard.gather.{unit.index}", self.group,
                                             unit.total, self.size, self.piece_kib)

    def _gather(self, unit: Unit) -> None:
        if unit.full:
            return
        self._start_gather(unit)
        began = time.perf_counter()
        flat, unit.gathering = unit.gathering.wait(), None
        self.stats["comm_s"] += time.perf_counter() - began
        unit.set_full(flat)

    def _arrived(self, unit: Unit, p: nn.Parameter) -> None:
        if self.whole:
            return
        if self.stage == 2:  # into the unit's flat gradient, which the reduce-scatter sends
            unit.take_grad(p)  # (stage 3 keeps p.grad until the unit's gathered values go)
        unit.arrived += 1
        if unit.arrived == len(unit.params):
            self._scatter(unit)

    def _scatter(self, unit: Unit) -> None:
        """Starts the reduce-scatter of the unit's gradient and drops the whole gradients (and,
        at stage 3, the gathered parameters)."""
        if self.stage == 3:
            # The gathered parameters go before the flat gradient is made: a whole parameter's
            # gradient, the flat gradient and the gathered unit are never all held at once
            # (the backward pass's peak, one unit less). The same values land in the same
            # places as when each gradient was moved in on arrival.
            unit.free()
            for p in unit.params:
                unit.take_grad(p)
        flat = unit.flat_grad()
        unit.arrived = 0
        for p in unit.params:
            p.grad = None
        # At most one in flight: the unit before's, which overlapped this unit's backward pass,
        # is received before this one starts (Horovod runs them in order anyway). A second in
        # flight through the next unit's backward pass held one more unit's gradient and
        # Horovod's buffers for it at the peak of resident memory.
        while self.in_flight:
            self._received(self.in_flight.pop(0))
        name = f"hvdtrain.shard.scatter.{unit.index}.{self.micro}"
        unit.scattering = start_reducescatter(flat.half() if self.half else flat, name,
                                              self.group, self.size, self.rank, hvd.Average,
                                              self.piece_kib)
        self.in_flight.append(unit)

    def _received(self, unit: Unit) -> None:
        began = time.perf_counter()
        unit.grad += unit.scattering.wait().float()
        self.stats["comm_s"] += time.perf_counter() - began
        unit.scattering = None

    def across_nodes(self) -> None:
        """shard.group=node: each shard's gradient of the step (averaged over the node, summed
        over the micro-batches) averaged over its replicas on the other nodes (a collective)."""
        wire = hvd.Compression.fp16 if self.half else hvd.Compression.none
        grads = [u.grad for u in self.units]
        began = time.perf_counter()
        for grad, got in zip(grads, across_nodes(grads, self.replicas, wire,
                                                 "hvdtrain.shard.cross"), strict=True):
            if got is not grad:
                grad.copy_(got)
        self.stats["comm_s"] += time.perf_counter() - began

    def settle(self) -> None:
        """After a backward pass: every unit's reduce-scatter sent (those whose parameters did
        not all get a gradient too) and added to its shard's gradient."""
        for unit in self.units:
            if unit.arrived:
                self._scatter(unit)
        for unit in self.in_flight:
            self._received(unit)
        self.in_flight = []
        self.micro += 1

    def zero_grad(self) -> None:
        """Before a step: the shards' gradients zeroed; at stage 3 every unit freed (a
        checkpoint or an evaluation may have left some gathered on every rank)."""
        self.micro = 0
        self.stats = {"comm_s": 0.0}  # a new dict: the last step's stay as they were
        for unit in self.units:
            unit.grad.zero_()
            for p in unit.params:
                p.grad = None
            if self.stage == 3 and not self.whole:
                unit.free()

    def after_step(self) -> None:
        """Stage 2: the updated shards all-gathered back into every rank's parameters (a
        collective); stage 3 gathers before each unit's next forward pass instead."""
        if self.stage == 2 or self.whole:
            began = time.perf_counter()
            # One unit at a time (the next one's started ahead): never a second whole model.
            handle = self._start_params(0)
            for k, unit in enumerate(self.units):
                flat = handle.wait()
                handle = self._start_params(k + 1)
                for p, view in unit.views(flat):
                    p.data.copy_(view)
            self.stats["comm_s"] += time.perf_counter() - began

    def _start_params(self, k: int) -> Any:
        if k >= len(self.units):
            return None
        unit = self.units[k]
        return start_allgather(unit.shard.detach(), f"hvdtrain.shard.params.{k}", self.group,
                               unit.total, self.size, self.piece_kib)

    def load_shards(self) -> None:
        """Stage 2: the shards taken from the parameters (a broadcast or restore reaches them)."""
        if self.stage == 2:
            for unit in self.units:
                if _aliased(unit):  # the shard is the parameters' own range already
                    continue
                flat = torch.cat([p.detach().reshape(-1) for p in unit.params])
                unit.shard.data.copy_(flat[unit.start:unit.stop])

    def gather_all(self, keep: bool) -> None:
        """Every unit's parameters gathered (a collective); ``keep``: they stay gathered and the
        hooks rest (the end of training), else only rank 0 keeps a copy for its checkpoint."""
        if self.stage == 2:
            return
        saved: dict[int, torch.Tensor] = {}
        for unit in self.units:
            if unit.full:
                flat = torch.cat([p.detach().reshape(-1) for p in unit.params])
            else:
                flat = hvd.allgather(unit.shard.detach(), name=f"hvdtrain.shard.all.{unit.index}",
                                     process_set=self.group)
            if keep:
                unit.set_full(flat.clone())
            elif self.keeper:
                for p, view in unit.views(flat):
                    saved[id(p)] = view.clone()
        self.whole = self.whole or keep
        self.saved = saved if self.keeper and not keep else None

    def _freed(self, module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters (by state-dict key) whose unit holds no gathered values now."""
        # Tied parameters (GPT-2's embedding and head) under each of their keys.
        for key, p in module.named_parameters(prefix=prefix, remove_duplicate=False):
            unit = self.unit_of.get(id(p))
            if unit is not None and not unit.full:
                yield key, p

    def _state_dict_hook(self, module: nn.Module, state: dict[str, Any], prefix: str,
                         local_metadata: Any) -> None:
        # A freed parameter has no data: a checkpoint gets rank 0's gathered copy, anything
        # else (the engine's broadcast) an empty tensor.
        for key, p in self._freed(module, prefix):
            saved = self.saved or {}
            state[key] = saved[id(p)] if id(p) in saved else torch.empty(0, dtype=p.dtype)

    def _load_hook(self, module: nn.Module, state: dict[str, Any], prefix: str, *args: Any
                   ) -> None:
        # A whole model's parameters (rank 0 restores alone): kept for broadcast(), which cuts
        # them into the shards; the freed parameters themselves load nothing.
        restored: dict[str, torch.Tensor] = {}
        self.popped = []
        for key, p in list(self._freed(module, prefix)):
            if key in state:
                restored[self.names[id(p)]] = state.pop(key)
                self.popped.append(key)
        self.restored = restored or None

    def _loaded(self, module: nn.Module, incompatible: Any) -> None:
        for key in self.popped:  # taken by _load_hook, not missing
            if key in incompatible.missing_keys:
                incompatible.missing_keys.remove(key)

    def broadcast(self, root_rank: int) -> None:
        """Stage 3: the parameters rank ``root_rank`` restored cut into every rank's shards,
        one unit at a time (a collective)."""
        if self.stage != 3:
            return
        restored = self.restored if hvd.rank() == root_rank else None
        self.restored = None
        # A pipeline stage's copies share their process set; shard.group=node spans the nodes.
        group = self.group if self.replicas is None else hvd.global_process_set
        if not hvd.broadcast_object(restored is not None, root_rank=root_rank,
                                    name="hvdtrain.shard.restored", process_set=group):
            return
        for unit in self.units:
            if restored is not None:
                flat = torch.cat([restored[self.names[id(p)]].reshape(-1).float()
                                  for p in unit.params])
            else:
                flat = torch.empty(unit.total)
            flat = hvd.broadcast(flat, root_rank, name=f"hvdtrain.shard.model.{unit.index}",
                                 process_set=group)
            unit.shard.data.copy_(flat[unit.start:unit.stop])
            if unit.full:
                unit.set_full(flat)


def _aliased(unit: Unit) -> bool:
    """Whether the unit's parameters are views of its flat buffer and its shard their range of
    it (stage 2, unless something replaced a parameter's data since)."""
    at = unit.flat.data_ptr() + unit.start * unit.flat.element_size()
    return unit.shard.data_ptr() == at and all(
        p.data_ptr() == view.data_ptr() for p, view in unit.views(unit.flat))


class UnitShardedOptimizer(torch.optim.Optimizer):
    """The run's optimizer over this rank's shard of every unit (stages 2 and 3).

    It stands where the run's optimizer stood for the step and for checkpoints, whose
    ``state_dict`` is the ring's layout (one entry per parameter of the model), as stage 1's
    :class:`hvdtrain.torch.shard.ShardedOptimizer` writes it: the two resume each other."""

    def __init__(self, optimizer: torch.optim.Optimizer, sharding: UnitSharding) -> None:
        self.sharding, self.units = sharding, sharding.units
        self.rank = sharding.rank
        self.process_set, self.replicas = sharding.group, sharding.replicas  # broadcast_shards'
        shards = [u.shard for u in self.units]
        super().__init__(shards, dict(optimizer.defaults))
        self.inner = same_optimizer(optimizer, shards)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        self._full: dict[str, Any] | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the shards' gradients (summed over a step's micro-batches)."""
        self.sharding.zero_grad()
        for unit in self.units:
            unit.shard.grad = None

    def gradients(self) -> list[torch.Tensor]:
        """The step's averaged gradient of each shard (the reduce-scatters waited for)."""
        self.sharding.settle()
        self.sharding.across_nodes()
        return [u.grad for u in self.units]

    def grad_norm(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """The global L2 norm of the step's gradient from this rank's shards of it (an
        allreduce of the sum of squares over the ranks sharing the model)."""
        local = torch.zeros((), dtype=torch.float64)
        for g in grads:
            local += g.detach().double().pow(2).sum()
        return hvd.allreduce(local, op=hvd.Sum, name="hvdtrain.shard.norm",
                             process_set=self.sharding.group).sqrt().float()

    def overflowed(self, grads: Sequence[torch.Tensor]) -> bool:
        """fp16: whether any rank's shards of the step's scaled gradient hold an inf or a NaN
        (one allreduce of a flag over every rank), as :class:`hvdtrain.torch.shard.ShardedOptimizer`
        decides it."""
        return any_rank(not all(bool(torch.isfinite(g).all()) for g in grads))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Steps the shards; stage 2 then all-gathers them into the parameters (a collective)."""
        self.sharding.load_shards()
        self.inner.step()
        self.sharding.after_step()

    def gather(self) -> None:
        """The model (stage 3) and the optimizer state gathered onto rank 0 in the ring's
        layout, for a checkpoint (a collective)."""
        self.sharding.gather_all(keep=False)
        own = self.inner.state_dict()
        state: dict[int, dict[str, Any]] = {}
        for u, unit in enumerate(self.units):
            for key, value in sorted(own["state"].get(u, {}).items()):
                if not sharded(value):
                    for p in unit.params:
                        state.setdefault(self.sharding.index[id(p)], {})[key] = (
                            value.clone() if torch.is_tensor(value) else value)
                    continue
                flat = hvd.allgather(value.detach(), name=f"hvdtrain.shard.state.{u}.{key}",
                                     process_set=self.sharding.group)
                for p, view in unit.views(flat):
                    state.setdefault(self.sharding.index[id(p)], {})[key] = view.clone()
        groups = [{**g, "params": list(range(self.sharding.count))} for g in own["param_groups"]]
        self._full = ({"state": state, "param_groups": groups} if self.sharding.keeper
                      else None)

    def state_dict(self) -> dict[str, Any]:
        """The state :meth:`gather` collected (rank 0), in the ring's layout."""
        if self._full is None:
            raise HvdtrainError("shard.stage 2-3: the optimizer state is written after "
                                "gather() only, on rank 0")
        full, self._full = self._full, None
        return full

    def load_state_dict(self, full: Mapping[str, Any]) -> None:
        """Takes this rank's shards of a state in the ring's layout; kept for :meth:`broadcast`."""
        self._full = dict(full)
        self._apply(full)

    def broadcast(self, root_rank: int = 0) -> None:
        """Every rank's shards of the state rank ``root_rank`` restored, one parameter's tensor
        at a time; a fresh start makes the state with one zero-gradient step, as Horovod's
        ``broadcast_optimizer_state`` does on the ring (a collective)."""
        self.sharding.broadcast(root_rank)
        broadcast_shards(self, root_rank)

    def _zero_step(self) -> None:
        for unit in self.units:  # the shards' own gradient buffers (zeroed before every step
            unit.shard.grad = unit.grad.zero_()  # anyway): no second set of shard-sized zeros
        self.step()
        for unit in self.units:
            unit.shard.grad = None

    def _apply(self, full: Mapping[str, Any],
               fetch: Callable[[int, str, Any], torch.Tensor] | None = None) -> None:
        groups = full["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != self.sharding.count:
            raise HvdtrainError(f"the optimizer state has {len(groups)} group(s) of "
                                f"{[len(g['params']) for g in groups]} parameters; this model "
                                f"has one group of {self.sharding.count}")
        own: dict[int, dict[str, Any]] = {}
        for u, unit in enumerate(self.units):
            pieces: dict[str, list[torch.Tensor]] = {}
            for p in unit.params:
                for key, value in full["state"].get(self.sharding.index[id(p)], {}).items():
                    if not (sharded(value) or isinstance(value, _Whole)):
                        own.setdefault(u, {}).setdefault(key, value)
                        continue
                    tensor = fetch(self.sharding.index[id(p)], key, value) if fetch else value
                    pieces.setdefault(key, []).append(tensor.reshape(-1))
            for key, parts in pieces.items():
                own.setdefault(u, {})[key] = torch.cat(parts)[unit.start:unit.stop].clone()
        self.inner.load_state_dict({"state": own,
                                    "param_groups": [{**groups[0],
                                                      "params": list(range(len(self.units)))}]})
        self.param_groups, self.state = self.inner.param_groups, self.inner.state


class UnitShardedExchange(GradientExchange):
    """Stages 2 and 3: the reduce-scatters run in the backward pass's hooks; :meth:`run` waits
    for them and hands each shard's averaged gradient to the update. ``wire_bytes``: what a
    rank hands Horovod a step (every micro-batch's gradient to reduce-scatter, float16 under
    ``fp16``; its float32 shards to all-gather: once at stage 2, before each forward and each
    backward pass at stage 3)."""

    def __init__(self, optimizer: UnitShardedOptimizer, accumulation: int) -> None:
        self.optimizer, self.sharding = optimizer, optimizer.sharding
        self.rank, self.size, self.accumulation = self.sharding.rank, self.sharding.size, accumulation
        self.job = (hvd.rank(), hvd.size())  # the job's rank and size, beside the shard's place
        self.stats = {"wire_bytes": 0.0, "dense_bytes": 0.0, "comm_s": 0.0, "compress_s": 0.0}

    def backward_starts(self, last: bool) -> None:
        if self.sharding.micro or any(u.scattering is not None for u in self.sharding.units):
            self.sharding.settle()  # the previous micro-batch's reduce-scatters

    def run(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = self.optimizer.gradients() if not grads else list(grads)
        total = sum(u.total for u in self.sharding.units)
        own = sum(u.stop - u.start for u in self.sharding.units)
        gathers = 1 if self.sharding.stage == 2 else self.accumulation * (
            2 if self.sharding.reshard else 1)
        item = 2 if self.sharding.half else 4
        # comm_s: the step's waits so far (gathers in the passes, the reduce-scatters); stage 2's
        # all-gather after the update adds its own to the same dict.
        self.stats = {"wire_bytes": float(self.accumulation * item * total + gathers * 4 * own),
                      "dense_bytes": float(self.accumulation * 4 * total + gathers * 4 * own),
                      "comm_s": self.sharding.stats["comm_s"], "compress_s": 0.0}
        if self.sharding.replicas is not None:  # once a step, the shards' sums of micro-batches
            self.stats = with_cross(self.stats, *cross_bytes(own, "fp16" if item == 2 else "none"))
        self.sharding.stats = self.stats
        return out

    def any_rank(self, flag: bool) -> bool:
        return any_rank(flag)

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        check_resize(*self.job, rank, size)

    def gather(self) -> None:
        self.optimizer.gather()

    def broadcast(self, root_rank: int = 0) -> None:
        self.optimizer.broadcast(root_rank)



def make_unit_sharded(optimizer: torch.optim.Optimizer, model: nn.Module, rank: int, size: int,
                      shard: Any, compression: str, accumulation: int, group: Any = None,
                      replicas: Any = None, root: int | None = 0
                      ) -> tuple[UnitShardedExchange, UnitShardedOptimizer]:
    """The exchange and optimizer of ``shard.stage`` 2 or 3 (``shard``: the config section)
    over ``rank`` of ``size`` data-parallel copies, standing for ``optimizer``; ``group``:
    their Horovod process set (None: every rank), ``replicas``: under shard.group=node, the set
    of the ranks holding the same shards on the other nodes; ``root``: the rank whose values
    stage 3 starts from (None: they agree already, a pipeline stage's copies)."""
    sharding = UnitSharding(model, shard.stage, rank, size, shard.unit_kib * 1024,
                            shard.prefetch, shard.reshard_after_forward, compression, group,
                            replicas, root)
    sharding.piece_kib = shard.piece_kib
    sharded_opt = UnitShardedOptimizer(optimizer, sharding)
    return UnitShardedExchange(sharded_opt, accumulation), sharded_opt
