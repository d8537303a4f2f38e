"""The records of ``allreduce_worker.py`` read back, by message size: framework-free.

Shared by ``cluster.py``'s bandwidth part (two nodes on shaped links) and the allreduce-bandwidth
investigation's driver (``docs/investigations/allreduce-bandwidth/allreduce.py``, one host).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import harness

KEY = "algbw_GBps"
"""The figure of a run: algorithm bandwidth, bytes / seconds per operation, in GB/s."""
RAW, HOROVOD, CONTROL, COPY = 0, 1, 2, 3
"""The worker's slots: raw backend (A), Horovod (B), raw again (A'), memory copy (C)."""
Tables = dict[int, list[harness.Row]]


def by_size(records: Sequence[dict[str, Any]], rounds: int) -> Tables:
    """Each size's rows (A, B, A', C in slot order), ratios to the raw backend A."""
    tables: Tables = {}
    for size in sorted({r["size"] for r in records}):
        mine = [r for r in records if r["size"] == size]
        names = [next(r["variant"] for r in mine if r["slot"] == slot)
                 for slot in sorted({r["slot"] for r in mine})]
        grouped = harness.group_runs(mine, names, rounds)
        tables[size] = harness.summarize(harness.samples_of(grouped, KEY), baseline=names[RAW])
    return tables


def human(size: int) -> str:
    """``4 KB``, ``1 MB``, ``256 MB``: binary units, as the sizes are powers of two."""
    for unit, shift in (("GB", 30), ("MB", 20), ("KB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):g} {unit}"
    return f"{size} B"


def bus(algbw: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth of an allreduce: what each link carried, comparable across n."""
    return algbw * 2 * (ranks - 1) / ranks
