"""The units of a PyTorch model for sharded data parallel and activation checkpointing
(docs/sharding.md): which modules they are (:func:`find_units`), each unit's flat shard
(:class:`Unit`), building a model one sharded layer at a time (:func:`build_by_units`), and
recomputing a unit's activations (:func:`checkpoint_units`). The hooks and collectives that use
them are :mod:`hvdtrain.torch.shard_units`'s."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hvdtrain.adapters import ModelAdapter
from hvdtrain.data.contracts import DatasetSpec
from hvdtrain.errors import HvdtrainError
from hvdtrain.shard import shard_bounds


def find_units(model: nn.Module, limit_bytes: int) -> list[nn.Module]:
    """The model's units in order: a ``Sequential``'s layers that hold parameters (a layer of
    more than ``limit_bytes`` cut as a model is), else the outermost modules holding at most
    ``limit_bytes`` of parameters (or holding no module).
    A parameter that two such modules share (tied embeddings: GPT-2's token embedding and
    head) is in no unit: the modules holding it are cut finer and the ones it alone fills left
    out, so it stays with the parameters in no unit (gathered for the whole pass)."""
    if isinstance(model, nn.Sequential):
        return [unit for m in model if _bytes(m) or hasattr(m, UNIT)  # UNIT: built sharded
                for unit in (_outermost(m, limit_bytes, set()) if _bytes(m) > limit_bytes
                             else []) or [m]]
    units = _outermost(model, limit_bytes, set())
    held = [id(p) for unit in units for p in unit.parameters()]
    shared = {i for i in held if held.count(i) > 1}
    return _outermost(model, limit_bytes, shared) if shared else units


def _outermost(model: nn.Module, limit_bytes: int, shared: set[int]) -> list[nn.Module]:
    """The outermost modules of at most ``limit_bytes`` holding none of ``shared``; a module
    list is never one (it is not called, so its hooks would never run), nor a module marked
    :data:`SPLIT`."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            size, leaf = _bytes(child), not any(True for _ in child.children())
            ties = any(id(p) in shared for p in child.parameters())
            container = isinstance(child, nn.ModuleList | nn.ModuleDict) or hasattr(child, SPLIT)
            if size and (size <= limit_bytes or leaf) and not ties and not container:
                units.append(child)
            elif size and not leaf:
                visit(child)

    visit(model)
    return units


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def checkpoint_units(model: nn.Module, limit_bytes: int) -> None:
    """Activation checkpointing: each unit's forward pass runs under ``torch.utils.checkpoint``
    (non-reentrant), so its activations are recomputed in the backward pass instead of kept."""
    for unit in find_units(model, limit_bytes):
        forward = unit.forward

        def recomputed(*args: Any, _forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # evaluation keeps nothing anyway
                return _forward(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False,
                                                     **kwargs)

        unit.forward = recomputed


def build_by_units(adapter: ModelAdapter, spec: DatasetSpec, seed: int, rank: int,
                   size: int, seed_rank: int | None = None) -> nn.Module | None:
    """Stage 3: the model built one layer at a time from the adapter's own ``layers()``, each
    layer's parameters cut to this rank's shard as soon as it exists, so that no rank ever holds
    the whole model. Every rank builds rank 0's values (the generator seeded as rank 0's), which
    the ring's broadcast would give it; each rank's generator then goes on as after ``build()``
    from its own seed ``seed + rank``.
    None where the adapter has no layers of its own (its model is then built whole).
    ``seed_rank``: the job's rank whose seed goes on, where it is not ``rank`` (the shard's
    place among ``size``: shard.group=node, pipeline stages)."""
    # An adapter whose layers() hand out parts of one model built whole (the Hugging Face
    # adapter's, marked ``whole_layers``) would gain nothing and lose its parameters' names.
    if type(adapter).layers is ModelAdapter.layers or getattr(adapter, "whole_layers", False):
        return None
    factories = adapter.layers(spec)
    if not factories:
        return None
    torch.manual_seed(seed)
    modules = []
    for make in factories:
        module = make()
        params = [p for p in module.parameters() if p.requires_grad]
        if params:
            unit = Unit(-1, module, params, rank, size)
            unit.free()
            setattr(module, UNIT, unit)
        modules.append(module)
    own = rank if seed_rank is None else seed_rank
    if own:
        # The ring's rank r draws its dropout from its own seed as consumed by build(): the
        # layers are made again from it, one at a time, and dropped.
        torch.manual_seed(seed + own)
        for make in factories:
            make()
    return nn.Sequential(*modules)


SPLIT = "_hvdtrain_split"
"""The attribute that marks a module as never one unit, cut into its children: one whose
output is no tensor (a ``transformers`` base model's), which a backward hook cannot see."""

UNIT = "_hvdtrain_unit"
"""The attribute of a layer :func:`build_by_units` has already sharded: its :class:`Unit`."""


class Unit:
    """One unit's trainable parameters and this rank's float32 shard of them (flat)."""

    def __init__(self, index: int, module: nn.Module | None, params: list[nn.Parameter],
                 rank: int, size: int) -> None:
        for p in params:
            if p.dtype != torch.float32 or not p.is_contiguous():
                raise HvdtrainError("shard.stage 2-3: every trainable parameter must be a "
                                    "contiguous float32 tensor")
        self.index, self.module, self.params = index, module, params
        self.shapes = [p.shape for p in params]
        self.sizes = [p.numel() for p in params]
        self.total = sum(self.sizes)
        self.start, self.stop = shard_bounds(self.total, size, rank)
        # The parameters become views of one flat buffer, whose storage free() releases in
        # place (as FSDP does): a view autograd saved in the forward pass (a weight's transpose)
        # then lets go of it too, which replacing each parameter's data would not.
        self.flat = torch.cat([p.detach().reshape(-1) for p in params])
        for p, view in self.views(self.flat):
            p.data = view
        self.shard = nn.Parameter(self.flat[self.start:self.stop].clone())
        self.grad = torch.zeros_like(self.shard)
        self.full = True  # whether the parameters hold their gathered values
        self.gathering: Any = None  # an all-gather's handle, started ahead
        self.scattering: Any = None  # the reduce-scatter of this micro-batch's gradient
        self.arrived = 0  # parameters whose gradient this backward pass has accumulated
        self.offsets = {id(p): at for p, at in zip(
            params, itertools.accumulate([0, *self.sizes[:-1]]), strict=True)}
        self.pending: torch.Tensor | None = None  # this backward pass's flat gradient so far

    def views(self, flat: torch.Tensor) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """Each parameter with its view into the unit's flat vector ``flat``."""
        at = 0
        for p, n, shape in zip(self.params, self.sizes, self.shapes, strict=True):
            yield p, flat[at:at + n].view(shape)
            at += n

    def set_full(self, flat: torch.Tensor) -> None:
        """The parameters take the gathered values ``flat`` (their buffer's storage back)."""
        storage = self.flat.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.total * self.flat.element_size())
        # Through .data: the parameters' version counter stays, so the tensors autograd saved
        # from them in the forward pass are still good in the backward pass.
        self.flat.data.copy_(flat)
        self.full = True

    def free(self) -> None:
        """Releases the gathered values (the parameters keep their shapes, not their data)."""
        self.flat.untyped_storage().resize_(0)
        self.full = False

    def take_grad(self, p: nn.Parameter) -> None:
        """Moves ``p``'s gradient (just accumulated) into the unit's flat gradient and drops it:
        the unit's whole gradient then exists once, where whole gradients concatenated at the
        unit's end existed twice at the backward pass's peak."""
        if p.grad is None:
            return
        if self.pending is None:  # zeros: a parameter that gets no gradient contributes none
            self.pending = torch.zeros(self.total, dtype=self.shard.dtype,
                                       device=self.shard.device)
        at = self.offsets[id(p)]
        self.pending[at:at + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None

    def flat_grad(self) -> torch.Tensor:
        """This backward pass's flat gradient (zeros where none arrived); the unit lets go of it."""
        flat, self.pending = self.pending, None
        return flat if flat is not None else torch.zeros(self.total, dtype=self.shard.dtype,
                                                         device=self.shard.device)
