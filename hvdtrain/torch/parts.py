"""The parts of a PyTorch checkpoint written by pipeline stages, to and from bytes.

A part (:data:`hvdtrain.pipeline.state.StagePart`) holds one stage's model entries by global name
(``"3.weight"``), its parameters' global names in its optimizer's order, and that optimizer's
``state_dict``; :func:`hvdtrain.pipeline.state.merge_parts` and ``select_part`` turn the parts of
any split into the share of any other (or the whole model's state). :func:`read_state` reads
every checkpoint file, whole or part, without running anything from it.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hvdtrain.checkpoint import not_a_checkpoint, part_file, sha256_of
from hvdtrain.compression.state import merge_named
from hvdtrain.errors import HvdtrainError
from hvdtrain.pipeline.state import StagePart, merge_parts
from hvdtrain.torch.compression import to_torch


def read_state(data: bytes, where: str) -> dict[str, Any]:
    """A checkpoint's entries (``model``, ``optimizer``, ``meta`` and more), read without running
    anything from it; a one-line error for a file that is not one."""
    # weights_only: loading a checkpoint must never execute code from the file.
    try:
        with warnings.catch_warnings():  # a foreign file's pickle protocol: the error says it
            warnings.simplefilter("ignore")
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # objects other than tensors: refused, never built
        raise not_a_checkpoint(where, "not a PyTorch file of tensors; nothing in it was "
                                      "run") from None
    except Exception as exc:  # noqa: BLE001  (whatever the file holds: one line naming it)
        raise not_a_checkpoint(where, exc) from None
    if not (isinstance(state, dict) and {"model", "optimizer", "meta"} <= state.keys()
            and isinstance(state["meta"], dict)):
        raise not_a_checkpoint(where, "no model, optimizer and meta entries")
    return state


def part_bytes(modules: Iterable[nn.Module], params: Sequence[str],
               optimizer: torch.optim.Optimizer, compression: Mapping[str, Any] | None = None
               ) -> bytes:
    """One stage's part serialised: its modules' entries (already named by global layer), the
    global names of its parameters in ``optimizer``'s order, the optimizer's state, and its
    exchange's state with slots by parameter name
    (:func:`hvdtrain.compression.state.by_name`; None without any)."""
    model = {k: v.detach().cpu().clone() for m in modules for k, v in m.state_dict().items()}
    buffer = io.BytesIO()
    # read_state's layout (model, optimizer, meta), so that the same safe reader reads it.
    torch.save({"model": model, "optimizer": optimizer.state_dict(), "meta": {},
                "params": list(params),
                "compression": to_torch(compression) if compression else None}, buffer)
    return buffer.getvalue()


def checked_part(directory: Path, entry: Mapping[str, Any], where: str) -> Path:
    """The part file that the manifest ``entry`` names in ``directory``, checked against its
    sha256; one-line errors naming the part (:func:`read_parts`)."""
    path = part_file(directory, entry, where)  # the very file verify() checked
    try:
        same = sha256_of(path) == entry.get("sha256")
    except OSError as exc:
        raise HvdtrainError(f"{where}: cannot read its part {path} "
                            f"({exc.strerror or exc})") from None
    if not same:
        raise HvdtrainError(f"{where}: its part {path} differs from the manifest (corrupted)")
    return path


def read_parts(directory: Path, entries: Sequence[Mapping[str, Any]], where: str) -> list[StagePart]:
    """The parts that ``entries`` (manifest entries) name, from ``directory``, each checked
    against its sha256 first; one-line errors naming the part, and for an entry that names a
    path rather than a file of ``directory`` (:func:`hvdtrain.checkpoint.part_file`)."""
    parts = []
    for entry in entries:
        path = checked_part(directory, entry, where)
        state = read_state(path.read_bytes(), f"part {path}")
        parts.append({"model": state["model"], "optimizer": state["optimizer"],
                      "params": list(state.get("params", ())),
                      "compression": state.get("compression")})
    return parts


def merged_parts(directory: Path, entries: Sequence[Mapping[str, Any]], all_params: Sequence[str],
                 where: str) -> tuple[dict, dict, dict]:
    """The whole model's entries and optimizer state (``all_params``: its parameters' names in
    its optimizer's order) from every part of a checkpoint written in parts, and the parts'
    exchange state merged, its slots by parameter name."""
    parts = read_parts(directory, entries, where)
    try:
        model, optimizer = merge_parts(parts, all_params)
    except ValueError as exc:
        raise HvdtrainError(f"{where} does not fit the model: {exc}") from None
    return model, optimizer, merge_named([p["compression"] for p in parts], where)
