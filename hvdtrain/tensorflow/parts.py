"""Keras state by global names, so that a TensorFlow checkpoint does not depend on the split.

A layer's variables are named ``"<layer>.<j>"`` (the j-th of ``layer.variables``, ``<layer>`` its
global index in the model's layer list), and an optimizer's slot variables after the variable they
belong to: ``"<layer>.<j>/momentum"``. Keras 3 names a slot after its variable's path
(``add_variable_from_reference``: ``"<path with _ for />_<slot>"``), which is how they are matched;
the optimizer's other variables (``iteration``, ``learning_rate``, a loss scale) are
``"opt/<name>"``. Entries are kept as ``model/<name>`` and ``optimizer/<name>`` arrays of an
``.npz`` file, read with ``allow_pickle=False``.

A pipeline stage's part also holds its gradient exchange's state (error-feedback residuals, DGC's
velocities, compressed Adam's moments, PowerSGD's ``Q``, the step) as ``compression/<kind>/<name>``
arrays, each slot under the global name of its trainable variable
(:func:`hvdtrain.compression.state.by_name`), so that it moves between parts of any split and a
checkpoint written whole, whose ``compression/<kind>/<index>`` arrays follow the whole model's
trainable variables.
"""

from __future__ import annotations

import io
import json
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.checkpoint import part_file, sha256_of
from hvdtrain.compression.state import merge_named
from hvdtrain.errors import HvdtrainError

COMPRESSION = "compression/"
"""The prefix of a checkpoint's exchange-state arrays."""


def layer_variables(layers: Iterable[Any], first: int) -> dict[str, Any]:
    """The variables of ``layers`` (global indices from ``first``) by global name."""
    return {f"{k}.{j}": v for k, layer in enumerate(layers, start=first)
            for j, v in enumerate(layer.variables)}


def optimizer_variables(optimizer: Any, model: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer's variables by global name (``model``: the model's variables by global
    name, as :func:`layer_variables` gives them)."""
    paths = {v.path.replace("/", "_"): name for name, v in model.items()}
    named: dict[str, Any] = {}
    for var in optimizer.variables:
        ref = reference(var.name, paths)
        key = f"{paths[ref]}/{var.name[len(ref) + 1:]}" if ref else f"opt/{var.name}"
        if key in named:
            raise HvdtrainError(f"optimizer variables {named[key].path} and {var.path} have the "
                                f"same global name {key!r}")
        named[key] = var
    return named


def reference(slot: str, paths: Collection[str]) -> str | None:
    """The longest ``path`` such that ``slot`` is ``"<path>_<kind>"`` (the longest:
    ``dense_1_kernel`` must not take ``dense_1_kernel_2``'s slots), or None."""
    cut = len(slot)
    while (cut := slot.rfind("_", 0, cut)) > 0:
        if slot[:cut] in paths:
            return slot[:cut]
    return None


def trainable_names(layers: Iterable[Any], first: int, variables: Iterable[Any]
                    ) -> list[str] | None:
    """The global names of ``variables`` (a model's trainable variables, in its exchange's order),
    which must belong to ``layers`` (global indices from ``first``); None where one does not (a
    model that is not its layers in order has no global names)."""
    named = {id(v): name for name, v in layer_variables(layers, first).items()}
    names = [named.get(id(v)) for v in variables]
    return None if any(name is None for name in names) else [str(name) for name in names]


def named_state(layers: Iterable[Any], first: int, optimizer: Any) -> dict[str, Any]:
    """Every variable of the model's ``layers`` and of its optimizer, as checkpoint entries
    (``model/<name>``, ``optimizer/<name>``)."""
    model = layer_variables(layers, first)
    return {**{f"model/{k}": v for k, v in model.items()},
            **{f"optimizer/{k}": v for k, v in optimizer_variables(optimizer, model).items()}}


def part_bytes(entries: Mapping[str, Any], compression: Mapping[str, Any] | None = None) -> bytes:
    """A part: the entries' values in an ``.npz`` (with an empty ``meta``, as checkpoints have),
    and the exchange's state by name (:data:`COMPRESSION` arrays) where there is one."""
    arrays: dict[str, Any] = {name: np.asarray(v.numpy()) for name, v in entries.items()}
    arrays |= {COMPRESSION + key: np.asarray(v) for key, v in (compression or {}).items()}
    buffer = io.BytesIO()
    np.savez(buffer, meta=np.array(json.dumps({})), **arrays)
    return buffer.getvalue()


def read_whole(path: Path, names: Collection[str], where: str) -> dict[str, np.ndarray]:
    """The entries ``names`` (``model/<name>``, ``optimizer/<name>``) of a checkpoint written
    whole, through the global names it lists (``names/model``, ``names/optimizer``); only those
    arrays are read."""
    lists = read_entries(path, ["names/model", "names/optimizer"], where)
    if len(lists) < 2:
        raise HvdtrainError(f"{where} lists no global names of its entries (written before "
                            "hvdtrain saved them, or not by a Sequential model): resume it "
                            "without pipeline stages")
    position = {f"{prefix}/{name}": f"{prefix}/{i}" for prefix in ("model", "optimizer")
                for i, name in enumerate(lists[f"names/{prefix}"].tolist())}
    found = read_entries(path, [position[n] for n in names if n in position], where)
    return {n: found[position[n]] for n in names if n in position and position[n] in found}


def read_part(path: Path, names: Collection[str], where: str, sha256: str | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The arrays of ``names`` that the part ``path`` holds, and its exchange state (the
    :data:`COMPRESSION` arrays without the prefix), read once after checking its sha256."""
    found = read_entries(path, names, where, sha256, prefix=COMPRESSION)
    return ({k: v for k, v in found.items() if not k.startswith(COMPRESSION)},
            {k[len(COMPRESSION):]: v for k, v in found.items() if k.startswith(COMPRESSION)})


def read_parts(directory: Path, manifest: Iterable[Mapping[str, Any]], names: Collection[str],
               where: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays of ``names`` held by the parts that ``manifest`` lists (read as
    :func:`iter_parts` reads them), and those parts' exchange states merged (slots by variable
    name: :func:`hvdtrain.compression.state.merge_named`)."""
    manifest = list(manifest)
    values: dict[str, np.ndarray] = {}
    states: list[dict[str, np.ndarray]] = [{} for _ in manifest]
    for k, name, value in iter_parts(directory, manifest, names, where, COMPRESSION):
        if name.startswith(COMPRESSION):
            states[k][name[len(COMPRESSION):]] = value
        else:
            values[name] = value
    return values, merge_named(states, where)


def iter_parts(directory: Path, manifest: Iterable[Mapping[str, Any]], names: Collection[str],
               where: str, prefix: str | None = None
               ) -> Iterator[tuple[int, str, np.ndarray]]:
    """``(k, name, array)`` for each array of ``names`` (and, of each part, every array whose
    name starts with ``prefix``) held by the parts that ``manifest`` lists, ``k`` the part's
    position in it; each part is checked against its sha256 before it is read, and each array
    is read from the file when it is reached (:func:`iter_entries`), so that a reader that
    assigns it and lets it go holds one at a time. An entry two parts hold, such as ``opt/``, is
    the first part's (a later part's copy is not read); an entry that names a path rather than
    a file of ``directory`` is refused (:func:`hvdtrain.checkpoint.part_file`)."""
    wanted = set(names)
    for k, part in enumerate(manifest):
        # The very file verify() checked; an entry that names a path is refused.
        path = part_file(directory, part, where)
        for name, value in iter_entries(path, set(wanted), where, part.get("sha256"), prefix):
            if prefix is None or not name.startswith(prefix):
                wanted.discard(name)
            yield k, name, value


def read_compression(path: Path, where: str) -> dict[str, np.ndarray]:
    """The exchange state of a checkpoint (:data:`COMPRESSION` arrays without the prefix; its
    slots by index where it was written whole); empty without one."""
    return read_part(path, (), where)[1]


def read_entries(path: Path, names: Collection[str], where: str, sha256: str | None = None,
                 prefix: str | None = None) -> dict[str, np.ndarray]:
    """The arrays of ``names`` (and every array whose name starts with ``prefix``) that the
    ``.npz`` file ``path`` holds (only those are read), after checking its sha256 when one is
    given."""
    return dict(iter_entries(path, names, where, sha256, prefix))


def iter_entries(path: Path, names: Collection[str], where: str, sha256: str | None = None,
                 prefix: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` for each array of ``names`` (and each whose name starts with ``prefix``)
    that the ``.npz`` file ``path`` holds, in the file's order, after checking its sha256 when
    one is given. Each array is read from the file when it is reached (``np.load`` opens the
    archive lazily; hvdtrain's parts are uncompressed), never the file whole."""
    try:
        if sha256 is not None and sha256_of(path) != sha256:
            raise HvdtrainError(f"{where}: its part {path} differs from the manifest (corrupted)")
        wanted = set(names)
        with np.load(path, allow_pickle=False) as npz:
            for name in npz.files:
                if name in wanted or (prefix is not None and name.startswith(prefix)):
                    yield name, npz[name]
    except HvdtrainError:
        raise
    except Exception as exc:  # noqa: BLE001  (whatever the file holds: one line naming it)
        raise HvdtrainError(f"{where}: cannot read {path} ({type(exc).__name__}: "
                            f"{(str(exc).splitlines() or [''])[0][:120]})") from None


def assign(entries: Mapping[str, Any], values: Mapping[str, np.ndarray], where: str) -> None:
    """Assigns each entry its value, or a one-line error naming what is missing or misshapen
    (``opt/`` entries are taken where present: a stage without loss scaling has none)."""
    check_complete(entries, values, where)
    for name, var in entries.items():
        if name in values:
            assign_one(var, name, values[name], where)


def assign_each(entries: Mapping[str, Any], values: Iterable[tuple[str, np.ndarray]],
                where: str) -> None:
    """Assigns each ``(name, array)`` of ``values`` to its entry as it comes (a reader such as
    :func:`iter_parts` then holds one array at a time), then the one-line error of
    :func:`assign` for an entry that got none (a caller saves nothing after that error)."""
    done: set[str] = set()
    for name, value in values:
        assign_one(entries[name], name, value, where)
        done.add(name)
    check_complete(entries, done, where)


def check_complete(entries: Collection[str], present: Collection[str], where: str) -> None:
    """A one-line error naming the first of ``entries`` that ``present`` lacks (``opt/``
    entries may be absent: a stage without loss scaling has none)."""
    missing = [n for n in entries if n not in present and not n.startswith("optimizer/opt/")]
    if missing:
        raise HvdtrainError(f"{where} does not fit the model: no entry {missing[0]} "
                            f"({len(missing)} missing)")


def assign_one(var: Any, name: str, value: np.ndarray, where: str) -> None:
    """Assigns ``value`` to the variable ``var`` of entry ``name``, or a one-line error when
    their shapes differ."""
    if tuple(var.shape) != value.shape:
        raise HvdtrainError(f"{where} does not fit the model: {name} has shape "
                            f"{value.shape}, the model has {tuple(var.shape)}")
    var.assign(value)
