"""Cutting the model's ordered list of layers into consecutive pieces, one per pipeline stage
(times ``pipeline.virtual_stages``).

A split is a list of bounds: piece ``i`` holds layers ``bounds[i]`` to ``bounds[i+1] - 1``, so
``bounds`` starts at 0, ends at the number of layers and has one more entry than there are
pieces. ``pipeline.split: auto`` balances the pieces' parameter counts (:func:`balanced_bounds`);
a list names the layers, by index or name, where the pieces after the first begin
(:func:`explicit_bounds`, torchtitan's split points).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from hvdtrain.configcheck import shown
from hvdtrain.errors import ConfigError


def stage_bounds(split: str | Sequence[int | str], costs: Sequence[int], names: Sequence[str],
                 pieces: int) -> list[int]:
    """The bounds of ``pieces`` pieces for ``pipeline.split`` over layers of the given ``costs``
    (parameter counts) and ``names``."""
    if len(costs) != len(names):
        raise ValueError(f"{len(costs)} costs for {len(names)} layers")
    if len(costs) < pieces:
        raise ConfigError(f"the model has {len(costs)} layers: too few for {pieces} pipeline "
                          "pieces (pipeline.stages x pipeline.virtual_stages)")
    if isinstance(split, str):
        return balanced_bounds(costs, pieces)
    return explicit_bounds(split, names, pieces)


def balanced_bounds(costs: Sequence[int], pieces: int) -> list[int]:
    """Bounds of ``pieces`` non-empty consecutive pieces whose largest total cost is the least
    possible (the first such split: earlier pieces take as much as that bound allows).

    Exact by dynamic programming over prefix sums, ``O(pieces * n^2)`` for ``n`` layers: models
    list tens to hundreds of layers.
    """
    n = len(costs)
    if not 1 <= pieces <= n:
        raise ValueError(f"cannot cut {n} layers into {pieces} non-empty pieces")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + int(c))
    # best[k][i]: the least largest cost of cutting layers [0, i) into k pieces; cut[k][i]: the
    # start of the last piece in that cut.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pieces + 1)]
    cut = [[0] * (n + 1) for _ in range(pieces + 1)]
    best[0][0] = 0
    for k in range(1, pieces + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                # "<=" keeps the latest j among equals: earlier pieces take more layers.
                if worst <= best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    bounds = [n]
    for k in range(pieces, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def explicit_bounds(split: Sequence[int | str], names: Sequence[str], pieces: int) -> list[int]:
    """Bounds from the layers (indices or names) where pieces 2, 3, ... begin."""
    n = len(names)
    if len(split) != pieces - 1:
        raise ConfigError(f"pipeline.split={shown(list(split))}: {pieces} pieces need "
                          f"{pieces - 1} layer(s) where the pieces after the first begin")
    starts = [_layer_index(item, names) for item in split]
    bounds = [0, *starts, n]
    if any(a >= b for a, b in itertools.pairwise(bounds)):
        raise ConfigError(f"pipeline.split={shown(list(split))}: the layers must be increasing, "
                          f"after layer 0 and before the end ({n} layers), leaving no piece "
                          "empty")
    return bounds


def layer_names(factories: Sequence[Any]) -> list[str]:
    """The name of each layer factory for ``pipeline.split``: its ``name`` attribute (see
    :class:`hvdtrain.adapters.Layer`), else its index as text."""
    return [str(getattr(f, "name", None) or i) for i, f in enumerate(factories)]


def _layer_index(item: int | str, names: Sequence[str]) -> int:
    if isinstance(item, int) and not isinstance(item, bool):
        if not 0 < item < len(names):
            raise ConfigError(f"pipeline.split: layer index {item} must lie in 1..{len(names) - 1}"
                              f" (the model has {len(names)} layers)")
        return item
    if isinstance(item, str) and item in names:
        return list(names).index(item)
    raise ConfigError(f"pipeline.split: no layer named {shown(item)}; the layers: "
                      f"{_listed(names)}")


def _listed(names: Sequence[str], limit: int = 300) -> str:
    """The names, comma-separated, cut short so that an error stays one readable line."""
    text = ", ".join(names)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."
