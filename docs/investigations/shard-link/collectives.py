"""Horovod's allreduce, reducescatter and allgather timed on the bytes of one step of
benchmarks/shard_link.py's MLP (issue 57's speed-against-the-ring target): the by-hand check
behind docs/benchmarks.md's "Sharded data parallel against the ring at 100 Mbit/s" section.

Run on the two shaped nodes of ``scripts/cluster_local.sh`` (one rank each), for example::

    .venv/bin/horovodrun -np 2 -H node1:1,node2:1 --gloo --network-interfaces br-hvd \\
        .venv/bin/python docs/investigations/shard-link/collectives.py

Rank 0 prints the median of 3 timings after one warm-up for each collective: a ring allreduce of
the whole float32 gradient (17.4 MB), a reduce-scatter of it, and an all-gather of the halves;
reduce-scatter plus all-gather move the allreduce's bytes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import horovod.torch as hvd
import torch

ELEMENTS = 64 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10  # the MLP 64-2048-2048-10


def median_seconds(call: Callable[[], object], repeats: int = 3) -> float:
    """The median wall time of ``repeats`` calls after one warm-up call."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    hvd.init()
    whole = torch.ones(ELEMENTS)
    half = torch.ones(ELEMENTS // 2 + 1)
    allreduce = median_seconds(lambda: hvd.allreduce(whole, op=hvd.Sum, name="ar"))
    reducescatter = median_seconds(lambda: hvd.reducescatter(whole, op=hvd.Sum, name="rs"))
    allgather = median_seconds(lambda: hvd.allgather(half, name="ag"))
    if hvd.rank() == 0:
        print(f"allreduce {allreduce:.3f} s; reducescatter {reducescatter:.3f} s; allgather of "
              f"halves {allgather:.3f} s; (rs + ag) / ar {(reducescatter + allgather) / allreduce:.2f}")


if __name__ == "__main__":
    main()
