"""Checkpoints of sharded data parallel written by every rank (framework-free; docs/sharding.md).

At every ``shard.stage`` each rank writes its own shard to ``step-N.rank-R.part`` (a safetensors
file): for each unit ``u`` of the model (stage 1: one unit, every trainable parameter), its slice
of the unit's flat float32 parameters (``u<u>.params``) and of each per-element optimizer slot
(``u<u>.exp_avg``, ...). Which slice is :func:`hvdtrain.shard.shard_bounds` of the unit's total
over the ranks that wrote. Rank 0's ``step-N.ckpt`` holds the rest (the model's entries that are
not trainable parameters, the optimizer's groups, the random and precision states) and the
:class:`ShardLayout` (``"shards"``): the units as parameter names and sizes, how many shards, the
slot names and the optimizer's scalars (a step count). The manifest lists every part with its
sha256 (:mod:`hvdtrain.checkpoint`): the usual commit.

A reader asks :meth:`ShardLayout.reads` where a run of one parameter's flat elements lies in the
parts, so that a run of another number of ranks, stage or cut into units reads only the byte
ranges of its own shard, and the ring or the export assembles one whole tensor at a time.
:func:`safetensors_header` lets a writer stream tensors into a safetensors file one at a time.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hvdtrain.errors import HvdtrainError
from hvdtrain.shard import shard_bounds

PARAMS = "params"
"""The kind of a part's tensor that holds the parameters (the others are optimizer slots)."""


def tensor_key(unit: int, kind: str) -> str:
    """The name of a unit's tensor of ``kind`` (``params`` or a slot) in a part file."""
    return f"u{unit}.{kind}"


def part_label(rank: int) -> str:
    """The label of rank ``rank``'s part (``step-N.<label>.part``)."""
    return f"rank-{rank}"


@dataclass(frozen=True)
class Read:
    """Elements [start, stop) of shard ``shard``'s tensor of unit ``unit``, which go to ``at``
    (from the first element asked for) in what the reader fills."""

    shard: int
    unit: int
    start: int
    stop: int
    at: int


@dataclass
class ShardLayout:
    """How a checkpoint's parameters and optimizer slots are cut into its part files."""

    units: list[list[tuple[str, int]]]
    """Each unit's trainable parameters (name, elements), in their flat order."""
    shards: int
    """How many shards each unit was cut into (the ranks that wrote)."""
    stage: int
    shapes: dict[str, list[int]] = field(default_factory=dict)
    """Each parameter's shape."""
    slots: dict[str, str] = field(default_factory=dict)
    """The optimizer's per-element slots and their safetensors dtypes (``F32``)."""
    scalars: list[dict[str, Any]] = field(default_factory=list)
    """Each unit's per-parameter optimizer entries (``step``), as the optimizer keeps them."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Other names of a shared parameter (a tied head), each to the name the units list."""

    def __post_init__(self) -> None:
        self._where = {name: (u, sum(n for _, n in unit[:k]), size)
                       for u, unit in enumerate(self.units)
                       for k, (name, size) in enumerate(unit)}

    def names(self) -> list[str]:
        """The trainable parameters' names, unit by unit."""
        return [name for unit in self.units for name, _ in unit]

    def size_of(self, name: str) -> int | None:
        """The elements of parameter ``name`` (None when the checkpoint has no such one)."""
        found = self._where.get(name)
        return None if found is None else found[2]

    def unit_of(self, name: str) -> int:
        """The unit that holds parameter ``name``."""
        return self._where[name][0]

    def reads(self, name: str, lo: int, hi: int) -> list[Read]:
        """Where the flat elements [lo, hi) of parameter ``name`` lie in the parts."""
        unit, offset, size = self._where[name]
        if not 0 <= lo <= hi <= size:
            raise ValueError(f"elements [{lo}, {hi}) of {name} (of {size})")
        total = sum(n for _, n in self.units[unit])
        out = []
        for shard in range(self.shards):
            a, b = shard_bounds(total, self.shards, shard)
            start, stop = max(a, offset + lo), min(b, offset + hi)
            if start < stop:
                out.append(Read(shard, unit, start - a, stop - a, start - offset - lo))
        return out

    def shard_lengths(self, shard: int) -> list[int]:
        """How many elements each unit's tensors hold in shard ``shard``'s part."""
        out = []
        for unit in self.units:
            a, b = shard_bounds(sum(n for _, n in unit), self.shards, shard)
            out.append(b - a)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The layout as rank 0's checkpoint file holds it."""
        return {"units": [[[name, size] for name, size in unit] for unit in self.units],
                "shards": self.shards, "stage": self.stage, "shapes": self.shapes,
                "slots": self.slots, "scalars": self.scalars, "aliases": self.aliases}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> ShardLayout:
        """The layout a checkpoint holds; a one-line error naming ``where`` when it is not one."""
        try:
            units = [[(str(name), int(size)) for name, size in unit] for unit in data["units"]]
            layout = cls(units, int(data["shards"]), int(data["stage"]),
                         {str(k): [int(d) for d in v] for k, v in data["shapes"].items()},
                         dict(data["slots"]), list(data["scalars"]), dict(data["aliases"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise HvdtrainError(f"{where}: its layout of shards is damaged ({exc!r})") from None
        if layout.shards < 1 or len(layout.scalars) not in (0, len(units)):
            raise HvdtrainError(f"{where}: its layout of shards is damaged")
        return layout


def shard_files(entries: Sequence[Mapping[str, Any]], layout: ShardLayout, where: str
                ) -> dict[int, Mapping[str, Any]]:
    """The manifest entry of the part that holds each shard (the first, where replicas of a shard
    group each wrote one); a one-line error when a shard has none."""
    found: dict[int, Mapping[str, Any]] = {}
    for entry in entries:
        shard = entry.get("shard")
        if isinstance(shard, int) and shard not in found:
            found[shard] = entry
    missing = [s for s in range(layout.shards) if s not in found]
    if missing:
        raise HvdtrainError(f"{where}: no part holds shard(s) {missing} of {layout.shards}")
    return found


def check_fits(layout: ShardLayout, params: Sequence[tuple[str, int]], where: str) -> None:
    """A one-line error when the checkpoint's trainable parameters are not ``params`` (name,
    elements) of this model."""
    mine = dict(params)
    theirs = {name: size for unit in layout.units for name, size in unit}
    if mine == theirs:
        return
    missing = sorted(set(mine) - set(theirs))
    extra = sorted(set(theirs) - set(mine))
    other = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
    what = (f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}" if extra
            else f"sizes differ at {other[:3]}")
    raise HvdtrainError(f"{where} does not fit the model: its sharded parameters: {what}")


def safetensors_header(tensors: Sequence[tuple[str, str, Sequence[int], int]],
                       metadata: Mapping[str, str]) -> bytes:
    """The first bytes of a safetensors file whose tensors (name, dtype such as ``F32``, shape,
    bytes) follow it in this order: the 8-byte length and the JSON header, padded to 8 bytes as
    safetensors pads it, so that a writer can stream each tensor's bytes after it."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    at = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


_Parts = TypeVar("_Parts", bound="PartFiles")


class PartFiles:
    """The part files of a checkpoint of shards, open for reading slices (a context manager):
    NumPy arrays here, the TensorFlow engine's reader; ``hvdtrain/torch/shard_files.py``'s
    subclass reads torch tensors (``FRAMEWORK``, safetensors' name for the array type)."""

    FRAMEWORK = "np"

    def __init__(self, paths: Mapping[int, Path], layout: ShardLayout, where: str) -> None:
        self.paths, self.layout, self.where = dict(paths), layout, where
        self.stack = contextlib.ExitStack()
        self.handles: dict[int, Any] = {}

    def __enter__(self: _Parts) -> _Parts:
        from safetensors import safe_open

        for shard, path in self.paths.items():
            try:
                self.handles[shard] = self.stack.enter_context(
                    safe_open(str(path), framework=self.FRAMEWORK))
            except Exception as exc:  # noqa: BLE001  (a missing or damaged part: one line)
                self.stack.close()
                raise HvdtrainError(f"{self.where}: cannot read its part {path} "
                                    f"({type(exc).__name__}: {exc})") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def read(self, shard: int, key: str, start: int, stop: int) -> Any:
        """Elements [start, stop) of a part's tensor, read without the rest of it."""
        try:
            return self.handles[shard].get_slice(key)[start:stop]
        except Exception as exc:  # noqa: BLE001  (a tensor the layout names is not there)
            raise HvdtrainError(f"{self.where}: part {self.paths[shard].name} lacks "
                                f"{key}[{start}:{stop}] ({exc})") from None

    def fill(self, out: Any, name: str, lo: int, kind: str) -> None:
        """``out`` (flat) given the elements [lo, lo + len(out)) of parameter ``name``'s
        ``kind`` (``params`` or a slot), from every part that holds some."""
        for r in self.layout.reads(name, lo, lo + len(out)):
            out[r.at:r.at + r.stop - r.start] = self.read(r.shard, tensor_key(r.unit, kind),
                                                           r.start, r.stop)
