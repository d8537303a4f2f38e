"""One Gloo all-gather against the same in rounds, on the shaped link (the second table of
README.md here). Run as ``collectives.py`` is; rank 0 prints one line of medians, in seconds::

    .venv/bin/horovodrun -np 2 -H node1:1,node2:1 --gloo --network-interfaces br-hvd \\
        .venv/bin/python docs/investigations/shard-link/pieces.py

(``TAG=x HOROVOD_FUSION_THRESHOLD=1048576`` before it: the same with a 1 MiB fusion buffer.)
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import horovod.torch as hvd
import torch

ELEMENTS = 4350000


def med(call: Callable[[], object], repeats: int = 3) -> float:
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
    n, rank = hvd.size(), hvd.rank()
    length = ELEMENTS // n
    whole = torch.arange(length * n, dtype=torch.float32)
    shard = whole[rank * length:(rank + 1) * length].clone()

    def in_turn(k: int) -> Callable[[], object]:
        return lambda: [hvd.allgather(p, name=f"p{k}.{i}") for i, p in enumerate(shard.chunk(k))]

    def together(k: int) -> Callable[[], object]:
        def call() -> object:
            handles = [hvd.allgather_async(p, name=f"a{k}.{i}")
                       for i, p in enumerate(shard.chunk(k))]
            return [hvd.synchronize(h) for h in handles]
        return call

    def scatter_in_turn(k: int) -> Callable[[], object]:
        return lambda: [hvd.reducescatter(p, name=f"r{k}.{i}") for i, p in enumerate(whole.chunk(k))]

    out = {"bcast one-way 8.7MB": med(lambda: hvd.broadcast(shard, 0, name="b1")),
           "allgather": med(lambda: hvd.allgather(shard, name="ag"))}
    for k in (4, 16, 64):
        out[f"ag seq x{k}"] = med(in_turn(k))
    out["ag async x16"] = med(together(16))
    for k in (4, 16):
        out[f"rs seq x{k}"] = med(scatter_in_turn(k))
    out["allreduce"] = med(lambda: hvd.allreduce(whole, name="ar"))
    if rank == 0:
        print(os.environ.get("TAG", ""), "; ".join(f"{a} {b:.3f}" for a, b in out.items()),
              flush=True)


if __name__ == "__main__":
    main()
