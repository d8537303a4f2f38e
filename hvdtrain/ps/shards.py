"""A server's shard of the flat vector and of the optimizer state, and the state's travel between
a server and worker 0 (``INIT``, ``STATE``): framework-free.

A shard is the concatenation of the chunks its server owns, in ascending chunk order
(:meth:`hvdtrain.ps.layout.ChunkLayout.owned`). A checkpoint keeps whole flat vectors, never shards, so
it does not depend on the number of servers: resuming on another number re-shards by the new
layout (:func:`take`), and since every update is elementwise the result is the same bits.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hvdtrain.ps.layout import ChunkLayout


def state_names(optimizer: str, momentum: float) -> tuple[str, ...]:
    """The optimizer state vectors a server keeps, in the order they travel: SGD's velocity (only
    with momentum), Adam's and AdamW's two moments."""
    if optimizer == "sgd":
        return ("momentum",) if momentum else ()
    return ("exp_avg", "exp_avg_sq")


def take(flat: np.ndarray, layout: ChunkLayout, server: int) -> np.ndarray:
    """Server ``server``'s shard of ``flat`` (a new contiguous vector)."""
    parts = [flat[start:stop] for start, stop in map(layout.bounds, layout.owned(server))]
    return np.ascontiguousarray(np.concatenate(parts) if parts else flat[:0])


def put(flat: np.ndarray, shard: np.ndarray, layout: ChunkLayout, server: int) -> None:
    """Writes server ``server``'s ``shard`` into its places in ``flat``."""
    at = 0
    for start, stop in map(layout.bounds, layout.owned(server)):
        flat[start:stop] = shard[at:at + stop - start]
        at += stop - start


def pack(params: np.ndarray, state: Mapping[str, np.ndarray], names: tuple[str, ...]) -> np.ndarray:
    """One float32 buffer: ``params`` then each state vector of ``names`` (none when ``state``
    is still empty: before the first step)."""
    arrays = [params, *(state[n] for n in names)] if state else [params]
    return np.ascontiguousarray(np.concatenate(arrays).astype(np.float32, copy=False))


def unpack(buffer: np.ndarray, elements: int, names: tuple[str, ...],
           arrays: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """:func:`pack`'s ``params`` and state back (copies); ``arrays`` is how many state vectors
    the buffer holds (0 or ``len(names)``)."""
    params = buffer[:elements].copy()
    state = {n: buffer[(i + 1) * elements:(i + 2) * elements].copy()
             for i, n in enumerate(names[:arrays])}
    return params, state
