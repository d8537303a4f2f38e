"""Checkpoints that do not depend on the split: the stages' parts merged into the whole model's
state, the whole model's cut into a stage's share, and which parts a rank of a new layout reads.

A part holds one stage's model entries named by global layer index (``"3.weight"``: layer 3 of the
layer list, as in the whole ``Sequential``), its parameters' global names and its optimizer's state
in PyTorch's layout; merged, they are what a run without stages writes (``state`` by parameter
index in the whole model's parameter order, one parameter group). So a run resumes with another
number of stages, another split, or none. The manifest lists each part's ``layers``
(:func:`parts_holding`, :func:`parts_misfit`). Framework-free: tensors are opaque values here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

StagePart = dict[str, Any]
"""One rank's share: ``model`` (its entries by global name), ``params`` (its parameters' global
names, in its optimizer's order) and ``optimizer`` (its optimizer's ``state_dict``)."""


def layer_of(key: str) -> int:
    """The global layer index of a model entry ``"<layer>.<name>"``."""
    return int(key.split(".", 1)[0])


def merge_parts(parts: Sequence[StagePart], all_params: Sequence[str]) -> tuple[dict, dict]:
    """The whole model's entries (in layer order) and optimizer state from the parts of every
    piece (each layer in exactly one part); ValueError for a parameter ``all_params`` lacks."""
    entries = [(key, value) for part in parts for key, value in part["model"].items()]
    model = dict(sorted(entries, key=lambda item: layer_of(item[0])))  # stable within a layer
    index = {name: i for i, name in enumerate(all_params)}
    state: dict[int, Any] = {}
    for part in parts:
        own = part["optimizer"]["state"]
        for local, name in enumerate(part["params"]):
            if name not in index:
                raise ValueError(f"its parts hold parameter {name!r}, which the model lacks")
            if local in own:
                state[index[name]] = own[local]
    hyper = {k: v for k, v in parts[0]["optimizer"]["param_groups"][0].items() if k != "params"}
    return model, {"state": state, "param_groups": [{**hyper, "params": list(range(len(index)))}]}


def select_part(model: Mapping[str, Any], optimizer: Mapping[str, Any], all_params: Sequence[str],
                own_params: Sequence[str], layers: Collection[int]) -> tuple[dict, dict]:
    """The model entries of ``layers`` and the optimizer state of ``own_params`` (in that
    order), from the whole model's (:func:`merge_parts`' layout)."""
    index = {name: i for i, name in enumerate(all_params)}
    whole = optimizer["state"]
    state = {local: whole[index[name]] for local, name in enumerate(own_params)
             if index[name] in whole}
    hyper = {k: v for k, v in optimizer["param_groups"][0].items() if k != "params"}
    part_model = {key: value for key, value in model.items() if layer_of(key) in layers}
    return part_model, {"state": state,
                        "param_groups": [{**hyper, "params": list(range(len(own_params)))}]}


def misfit(model_keys: Collection[str], optimizer: Any, all_keys: Collection[str],
           all_params: Sequence[str]) -> str | None:
    """Why a checkpoint's entries do not fit the model's layers, or None when they do."""
    missing, unexpected = set(all_keys) - set(model_keys), set(model_keys) - set(all_keys)
    if missing or unexpected:
        first = sorted(missing)[:3] or sorted(unexpected)[:3]
        return (f"{len(missing)} model entries missing and {len(unexpected)} unexpected (e.g. "
                f"{', '.join(first)})")
    groups = optimizer.get("param_groups") if isinstance(optimizer, Mapping) else None
    if not groups or len(groups) != 1 or len(groups[0].get("params", ())) != len(all_params):
        return "its optimizer state is not of one group over the model's parameters"
    return None


def parts_holding(parts: Sequence[Mapping[str, Any]], layers: Collection[int]) -> list[dict]:
    """The manifest entries (``file``, ``layers``, ...) of the parts that hold any of ``layers``:
    all that a rank holding ``layers`` reads of a checkpoint written in parts."""
    wanted = set(layers)
    return [dict(p) for p in parts if wanted & set(p["layers"])]


def parts_misfit(parts: Sequence[Mapping[str, Any]], count: int) -> str | None:
    """Why the parts of a checkpoint do not hold each of the model's ``count`` layers exactly once,
    or None when they do."""
    held = [layer for p in parts for layer in p.get("layers", ())]
    if sorted(held) == list(range(count)):
        return None
    return (f"its parts hold layers {sorted(set(held))[:8]}{'...' if len(set(held)) > 8 else ''} "
            f"({len(held)} in all), the model has {count} (0-{count - 1})")
