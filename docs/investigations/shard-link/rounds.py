"""Rounds on the shaped link, with the per-round cost beside the bytes: the all-gather of the
MLP's 17.4 MB whole and in rounds of 128 KiB a rank (hvdtrain's ``start_allgather``, one round in
flight), and in the same rounds two in flight (the odd rounds viewed as int32, so that Horovod,
which fuses only tensors of one dtype, cannot fuse the two); the reduce-scatter whole, in 128 KiB
rounds (``start_reducescatter``) and in 2 MiB rounds. Run as ``collectives.py`` is::

    .venv/bin/horovodrun -np 2 -H node1:1,node2:1 --gloo --network-interfaces br-hvd \\
        .venv/bin/python docs/investigations/shard-link/rounds.py

Rank 0 prints the median of 3 after one warm-up per way, the rounds, and the time a round costs
beyond the bytes' (the median less the one-collective bound M/(2B) at 0.94 of 100 Mbit/s,
divided by the rounds). Results are checked against one collective.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import horovod.torch as hvd
import torch

from hvdtrain.shard import pieces
from hvdtrain.torch.collectives import start_allgather, start_reducescatter

ELEMENTS = 64 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10
RATE = 0.94 * 100e6 / 8  # bytes a second TCP carries on the shaped link


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
    group = hvd.global_process_set
    bound = 4 * length * (n - 1) / RATE

    def gather(kib: int) -> Callable[[], torch.Tensor]:
        return lambda: start_allgather(shard, f"g{kib}", group, length * n, n, kib).wait()

    def two_in_flight() -> torch.Tensor:
        parts = list(shard.split(32768))
        out: list[torch.Tensor] = [torch.empty(0)] * len(parts)

        def start(k: int) -> object:
            part = parts[k].view(torch.int32) if k % 2 else parts[k]
            return hvd.allgather_async(part, name=f"two.{k}")

        handles = [start(0), start(1)]
        for k in range(len(parts)):
            got = hvd.synchronize(handles[k])
            if k + 2 < len(parts):
                handles.append(start(k + 2))
            out[k] = got.view(torch.float32).view(n, -1)
        return torch.cat([torch.cat([o[r] for o in out]) for r in range(n)])

    def scatter(kib: int) -> Callable[[], torch.Tensor]:
        return lambda: start_reducescatter(whole, f"s{kib}", group, n, rank, hvd.Sum,
                                           kib).wait()

    lines = []
    for label, call, rounds in (
            ("allgather whole", gather(0), 1),
            ("allgather 128 KiB, 1 in flight", gather(128), pieces(length * n, n, 32768)),
            ("allgather 128 KiB, 2 in flight", two_in_flight, pieces(length * n, n, 32768)),
            ("reducescatter whole", lambda: hvd.reducescatter(whole, op=hvd.Sum, name="rw"), 1),
            ("reducescatter 128 KiB", scatter(128), pieces(length * n, n, 32768)),
            ("reducescatter 2 MiB", scatter(2048), pieces(length * n, n, 524288))):
        got = call()
        want = whole if label.startswith("allgather") else whole[rank * length:(rank + 1) * length] * n
        if not torch.equal(got, want):
            raise SystemExit(f"{label}: wrong result")
        seconds = med(call)
        lines.append(f"{label}: {seconds:.3f} s, {rounds} round(s), "
                     f"{1e3 * (seconds - bound) / rounds:+.1f} ms a round beyond the bytes")
    if rank == 0:
        print(f"bound {bound:.3f} s; " + "; ".join(lines), flush=True)


if __name__ == "__main__":
    main()
