"""Checkpoints of sharded data parallel in PyTorch written by every rank (docs/sharding.md): the
tensors of :mod:`hvdtrain.shard_files`'s layout.

- **Writing** (:func:`shard_part`, on every rank at once): a rank streams its float32 shard of each
  unit's parameters and of each per-element optimizer slot into its own safetensors file, tensor
  by tensor from where they live (no copy, nothing gathered); rank 0's checkpoint file then holds
  :func:`rank0_contents`: the layout, the optimizer's groups and scalars and the model's entries
  that are not trainable parameters (buffers, frozen layers).
- **Resuming sharded** (:func:`restore_shards`, a collective): rank 0 read its file and hands the
  layout on; every rank reads only the byte ranges of its own new shards from the parts
  (safetensors' ``get_slice``), at any stage, number of ranks or cut into units; stages 1 and 2
  then all-gather the parameters, as after a step.
- **Resuming on the ring** (:func:`whole_state`, rank 0) and **exporting** (:func:`write_export`)
  assemble one whole tensor at a time from the parts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import horovod.torch as hvd
import torch
from torch import nn

from hvdtrain.checkpoint import part_file
from hvdtrain.errors import HvdtrainError
from hvdtrain.shard import segments
from hvdtrain.shard_files import (
    PARAMS,
    PartFiles,
    ShardLayout,
    check_fits,
    part_label,
    safetensors_header,
    shard_files,
    tensor_key,
)
from hvdtrain.torch.shard import ShardedOptimizer, sharded
from hvdtrain.torch.shard_units import UnitShardedOptimizer

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass
class UnitView:
    """One unit of a sharded optimizer as its checkpoint sees it: its parameters' names and
    sizes, this rank's [start, stop) of its flat vector, the float32 shard and the index of the
    shard in the inner optimizer."""

    names: list[str]
    sizes: list[int]
    start: int
    stop: int
    shard: torch.Tensor
    key: int


def is_sharded(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of ``shard.stage`` 1-3's, whose ranks write their own shards."""
    return isinstance(optimizer, ShardedOptimizer | UnitShardedOptimizer)


def views_of(opt: Any, model: nn.Module) -> list[UnitView]:
    """The units of a sharded optimizer (stage 1: one, every trainable parameter)."""
    if isinstance(opt, ShardedOptimizer):
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        return [UnitView(names, list(opt.sizes), opt.start, opt.stop, opt.shard, 0)]
    return [UnitView([opt.sharding.names[id(p)] for p in unit.params], list(unit.sizes),
                     unit.start, unit.stop, unit.shard, u) for u, unit in enumerate(opt.units)]


def _shards_of(opt: Any) -> tuple[int, int]:
    """This rank's shard and the number of shards (of the ranks that share the model)."""
    owner = opt if isinstance(opt, ShardedOptimizer) else opt.sharding
    return owner.rank, owner.size


def _refresh(opt: Any) -> None:
    """Stages 1 and 2 take their shards from the parameters at each step's start: a checkpoint
    takes them the same way (stage 3's shards are the parameters)."""
    if isinstance(opt, ShardedOptimizer):
        opt._load_shard()
    else:
        opt.sharding.load_shards()


def layout_of(opt: Any, model: nn.Module) -> ShardLayout:
    """The layout of the shards this run writes, with the optimizer's slots and scalars."""
    views, state = views_of(opt, model), opt.inner.state_dict()["state"]
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    first = {id(p): n for n, p in trainable.items()}
    aliases = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
               if id(p) in first and first[id(p)] != n}
    slots = {k: NAMES[v.dtype] for view in views for k, v in state.get(view.key, {}).items()
             if sharded(v)}
    scalars = [{k: v.clone() if torch.is_tensor(v) else v
                for k, v in state.get(view.key, {}).items() if not sharded(v)} for view in views]
    return ShardLayout([list(zip(v.names, v.sizes, strict=True)) for v in views],
                       _shards_of(opt)[1], 1 if isinstance(opt, ShardedOptimizer) else
                       opt.sharding.stage, {n: list(p.shape) for n, p in trainable.items()},
                       slots, scalars, aliases)


def shard_part(opt: Any, model: nn.Module, rank: int
               ) -> tuple[str, dict[str, Any], Any]:
    """This rank's part: its label, its manifest fields (``shard`` of ``of``) and the writer that
    streams its shards into a safetensors file."""
    _refresh(opt)
    shard, shards = _shards_of(opt)
    views, state = views_of(opt, model), opt.inner.state_dict()["state"]
    slots = sorted(k for view in views for k, v in state.get(view.key, {}).items() if sharded(v))
    tensors = []
    for u, view in enumerate(views):
        tensors.append((tensor_key(u, PARAMS), view.shard.detach()))
        for key in dict.fromkeys(slots):
            value = state.get(view.key, {}).get(key)
            if value is None:
                raise HvdtrainError(f"shard.stage: unit {u} has no optimizer slot {key!r}")
            tensors.append((tensor_key(u, key), value.detach()))

    def write(fileobj: IO[bytes]) -> None:
        header = [(name, NAMES[t.dtype], list(t.shape), t.numel() * t.element_size())
                  for name, t in tensors]
        fileobj.write(safetensors_header(header, {"format": "pt", "shard": str(shard),
                                                  "shards": str(shards)}))
        for _, tensor in tensors:
            _write_tensor(fileobj, tensor)

    return part_label(rank), {"shard": shard, "of": shards}, write


def _write_tensor(fileobj: IO[bytes], tensor: torch.Tensor) -> None:
    """A tensor's bytes as safetensors holds them (little-endian, C order), without a copy where
    it is a contiguous CPU tensor already."""
    if tensor.numel():
        flat = tensor.detach().contiguous().cpu().reshape(-1)
        fileobj.write(flat.view(torch.uint8).numpy().data)


def rank0_contents(opt: Any, model: nn.Module) -> dict[str, Any]:
    """Rank 0's checkpoint entries beside the parts: the model's entries that are not trainable
    parameters, the optimizer's groups (no state) and the layout (``shards``)."""
    layout = layout_of(opt, model)
    trainable = {*layout.names(), *layout.aliases}
    rest = {k: v for k, v in model.state_dict().items() if k not in trainable}
    groups = [{**g, "params": list(range(len(list(model.parameters()))))}
              for g in opt.inner.state_dict()["param_groups"]]
    return {"model": rest, "optimizer": {"state": {}, "param_groups": groups},
            "shards": layout.to_dict()}


def load_rest(model: nn.Module, entries: Mapping[str, Any], layout: ShardLayout,
              where: str) -> None:
    """Loads a sharded checkpoint's model entries that are not trainable parameters (which the
    parts hold); a one-line error when any other entry is missing or left over."""
    result = model.load_state_dict(dict(entries), strict=False)
    held = {*layout.names(), *layout.aliases}
    missing = [k for k in result.missing_keys if k not in held]
    if missing or result.unexpected_keys:
        raise HvdtrainError(f"{where} does not fit the model: missing {missing[:3]}, "
                            f"unexpected {list(result.unexpected_keys)[:3]}")


class Parts(PartFiles):
    """The part files of a sharded checkpoint, open for reading slices as torch tensors."""

    FRAMEWORK = "pt"

    def __init__(self, directory: Path, entries: Sequence[Mapping[str, Any]],
                 layout: ShardLayout, where: str) -> None:
        super().__init__({shard: part_file(directory, entry, where)
                          for shard, entry in shard_files(entries, layout, where).items()},
                         layout, where)

    def whole(self, name: str, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """Parameter ``name``'s ``kind`` whole, in its shape."""
        out = torch.empty(self.layout.size_of(name) or 0, dtype=dtype)
        self.fill(out, name, 0, kind)
        return out.view(self.layout.shapes[name])


def _read_view(parts: Parts, view: UnitView, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """This rank's shard of a unit's ``kind``, read from the parts written by any layout."""
    out = torch.empty(view.stop - view.start, dtype=dtype)
    for seg in segments(view.sizes, view.start, view.stop):
        at = seg.flat - view.start
        parts.fill(out[at:at + seg.length], view.names[seg.param], seg.offset, kind)
    return out


@torch.no_grad()
def restore_shards(opt: Any, model: nn.Module, source: dict[str, Any] | None) -> bool:
    """Every rank reads its shards of the checkpoint that rank 0 found (``source``: its
    directory, parts, layout, groups; None on the other ranks, or when rank 0 restored nothing
    in parts) into ``opt`` and, at stages 1 and 2, the parameters. A collective; returns whether
    it restored anything."""
    source = hvd.broadcast_object(source, root_rank=0, name="hvdtrain.shard.files")
    if source is None:
        return False
    where = source["where"]
    layout = ShardLayout.from_dict(source["layout"], where)
    views = views_of(opt, model)
    check_fits(layout, [(n, s) for v in views for n, s in zip(v.names, v.sizes, strict=True)],
               where)
    state: dict[int, dict[str, Any]] = {}
    with Parts(Path(source["directory"]), source["entries"], layout, where) as parts:
        for view in views:
            view.shard.data.copy_(_read_view(parts, view, PARAMS, torch.float32))
            entry = {key: _read_view(parts, view, key, DTYPES[dtype])
                     for key, dtype in layout.slots.items()}
            entry.update(_scalars(layout, view.names[0]))
            if entry:
                state[view.key] = entry
    if len(source["groups"]) != 1:
        raise HvdtrainError(f"{where} does not fit the model: its optimizer has "
                            f"{len(source['groups'])} groups of parameters, this one has 1")
    group = source["groups"][0]
    opt.inner.load_state_dict({"state": state,
                               "param_groups": [{**group, "params": [v.key for v in views]}]})
    opt.param_groups, opt.state = opt.inner.param_groups, opt.inner.state
    opt.restored_shards = True  # no zero-gradient step to make a state: it has one
    _spread(opt)
    return True


def _scalars(layout: ShardLayout, name: str) -> dict[str, Any]:
    """The optimizer's scalars of the unit that held ``name`` (copies: Adam counts its step in
    place, so no two units may share one)."""
    if not layout.scalars:
        return {}
    return {k: v.clone() if torch.is_tensor(v) else v
            for k, v in layout.scalars[layout.unit_of(name)].items()}


def _spread(opt: Any) -> None:
    """Stages 1 and 2: the restored shards all-gathered into every rank's parameters, as after a
    step (a collective); stage 3 gathers before each unit's next forward pass."""
    if isinstance(opt, ShardedOptimizer):
        opt.allgather(opt.shard.detach(), [p.view(-1) for p in opt.params].__getitem__, "params")
    else:
        opt.sharding.after_step()


def whole_state(source: Mapping[str, Any], model: nn.Module) -> tuple[dict, dict]:
    """The whole model's entries and optimizer state (the ring's layout, for a run without
    sharding) assembled from a sharded checkpoint's parts, one tensor at a time."""
    layout = ShardLayout.from_dict(source["layout"], source["where"])
    check_fits(layout, [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad],
               source["where"])
    entries = {**source["model"], **whole_params(source)}
    return entries, whole_optimizer(source, [name for name, _ in model.named_parameters()])


def whole_optimizer(source: Mapping[str, Any], names: Sequence[str] | None = None) -> dict:
    """A sharded checkpoint's optimizer state in the ring's layout: an entry per parameter, by its
    index in ``names`` (the model's parameters in order; None: the checkpoint's trainable
    parameters, unit by unit, which is the model's order at stage 1), each tensor read whole."""
    where = source["where"]
    layout = ShardLayout.from_dict(source["layout"], where)
    state: dict[int, dict[str, Any]] = {}
    with Parts(Path(source["directory"]), source["entries"], layout, where) as parts:
        for index, name in enumerate(layout.names() if names is None else names):
            if layout.size_of(name) is None:
                continue  # frozen: no optimizer state
            state[index] = {key: parts.whole(name, key, DTYPES[dtype])
                            for key, dtype in layout.slots.items()}
            state[index].update(_scalars(layout, name))
    return {"state": state, "param_groups": source["groups"]}


def whole_params(source: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every trainable parameter of a sharded checkpoint, whole, by name (its aliases too)."""
    where = source["where"]
    layout = ShardLayout.from_dict(source["layout"], where)
    with Parts(Path(source["directory"]), source["entries"], layout, where) as parts:
        out = {name: parts.whole(name, PARAMS, torch.float32) for name in layout.names()}
    return {**out, **{alias: out[name] for alias, name in layout.aliases.items()}}


def write_export(source: Mapping[str, Any], path: Path, meta: Mapping[str, Any],
                 rest: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> None:
    """``path`` (safetensors) of a sharded checkpoint's model: each trainable parameter read
    whole from the parts and written one at a time after a header that names them all, then
    ``rest``, the model's other entries (each storage once, ``aliases`` naming the others); a
    shared parameter's other names are listed as ``aliases`` in the metadata, as
    :func:`hvdtrain.torch.export.write_safetensors` lists them."""
    where = source["where"]
    layout = ShardLayout.from_dict(source["layout"], where)
    names = layout.names()
    header = [(n, "F32", layout.shapes[n], 4 * (layout.size_of(n) or 0)) for n in names]
    header += [(k, NAMES[t.dtype], list(t.shape), t.numel() * t.element_size())
               for k, t in rest.items()]
    metadata = {"format": "pt", "aliases": json.dumps({**layout.aliases, **aliases}),
                "step": str(meta.get("position", {}).get("step", ""))}
    path.parent.mkdir(parents=True, exist_ok=True)
    with Parts(Path(source["directory"]), source["entries"], layout, where) as parts, \
            path.open("wb") as fileobj:
        fileobj.write(safetensors_header(header, metadata))
        for name in names:  # one whole tensor in memory at a time
            _write_tensor(fileobj, parts.whole(name, PARAMS, torch.float32))
        for tensor in rest.values():
            _write_tensor(fileobj, tensor)


def sources(state: Mapping[str, Any], restore_from: Path | None, where: str
            ) -> dict[str, Any] | None:
    """What reading a sharded checkpoint needs, from rank 0's file (``state``, read by
    :func:`hvdtrain.torch.parts.read_state`) at ``restore_from``; None for a checkpoint written
    whole."""
    if state.get("shards") is None:
        return None
    if restore_from is None:
        raise HvdtrainError(f"{where}: a checkpoint of shards is read from its file only")
    return {"directory": str(restore_from.parent), "entries": state["meta"].get("parts") or [],
            "layout": state["shards"], "groups": state["optimizer"].get("param_groups", []),
            "model": state["model"], "where": where}

