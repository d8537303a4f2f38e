"""Horovod's collectives timed on the bytes of one step of benchmarks/shard_link.py's MLP (issue
57's speed-against-the-ring target): the by-hand check behind docs/benchmarks.md's "Sharded data
parallel against the ring at 100 Mbit/s" section, and the ways of building an all-gather from
Horovod's other collectives that hvdtrain's ``shard.allgather`` chooses between.

Run on the shaped nodes of ``scripts/cluster_local.sh`` (one rank each), under Gloo or MPI::

    .venv/bin/horovodrun -np 2 -H node1:1,node2:1 --gloo --network-interfaces br-hvd \\
        .venv/bin/python docs/investigations/shard-link/collectives.py [ELEMENTS ...]

Rank 0 prints the median of 3 timings after one warm-up for each collective on a float32 vector
of ELEMENTS (default: the MLP 64-2048-2048-10's 4.35 M, 17.4 MB; stage 1 gathers it in rounds of
``shard.chunk_kib``): a ring allreduce of the whole, a reduce-scatter of it, and the all-gather of
the 1/N shards six ways (Horovod's allgather; grouped_allgather of 4 parts; alltoall of the shard
repeated N times; allreduce of the whole with zeros outside the shard; one broadcast from every
rank, all in flight at once; hvdtrain's rounds of ``shard.piece_kib``, one after another, as the
reduce-scatter too). Each all-gather's result is checked against the expected vector.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import horovod.torch as hvd
import torch

from hvdtrain.torch.collectives import start_allgather, start_reducescatter

PIECE_KIB = 128
"""``shard.piece_kib``'s rounds (hvdtrain's :func:`~hvdtrain.torch.collectives.start_allgather`)."""
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


def gathers(shard: torch.Tensor, n: int, rank: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The all-gathers of ``shard`` (equal shards on every rank) by name."""
    length = shard.numel()

    def padded() -> torch.Tensor:
        whole = torch.zeros(length * n)
        whole[rank * length:(rank + 1) * length] = shard
        return hvd.allreduce(whole, op=hvd.Sum, name="pad")

    def broadcasts() -> torch.Tensor:
        parts = [shard.clone() if r == rank else torch.empty(length) for r in range(n)]
        handles = [hvd.broadcast_async_(p, r, name=f"bc.{r}") for r, p in enumerate(parts)]
        return torch.cat([hvd.synchronize(h) for h in handles])

    def grouped() -> torch.Tensor:
        parts = hvd.grouped_allgather(list(shard.chunk(4)), name="gag")
        per = [p.view(n, -1) for p in parts]
        return torch.cat([torch.cat([p[r] for p in per]) for r in range(n)])

    return {"allgather": lambda: hvd.allgather(shard, name="ag"),
            "grouped_allgather x4": grouped,
            "alltoall": lambda: hvd.alltoall(shard.repeat(n), name="a2a"),
            "allreduce of zero-padded": padded,
            "broadcast from each": broadcasts,
            f"allgather in {PIECE_KIB} KiB rounds": lambda: start_allgather(
                shard, "agp", hvd.global_process_set, length * n, n, PIECE_KIB).wait()}


def main() -> None:
    hvd.init()
    n, rank = hvd.size(), hvd.rank()
    for elements in [int(a) for a in sys.argv[1:]] or [ELEMENTS]:
        length = elements // n
        whole = torch.arange(length * n, dtype=torch.float32)
        shard = whole[rank * length:(rank + 1) * length].clone()
        times = {"allreduce": median_seconds(
                     lambda w=whole: hvd.allreduce(w, op=hvd.Sum, name="ar")),
                 "reducescatter": median_seconds(
                     lambda w=whole: hvd.reducescatter(w, op=hvd.Sum, name="rs")),
                 f"reducescatter in {PIECE_KIB} KiB rounds": median_seconds(
                     lambda w=whole: start_reducescatter(w, "rsp", hvd.global_process_set, n,
                                                         rank, hvd.Sum, PIECE_KIB).wait())}
        for name, call in gathers(shard, n, rank).items():
            if not torch.equal(call(), whole):
                raise SystemExit(f"{name}: wrong result")
            times[name] = median_seconds(call)
        if rank == 0:
            mb = 4 * length * n / 1e6
            print(f"{mb:.1f} MB over {n} ranks: " + "; ".join(
                f"{k} {v:.3f} s" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
