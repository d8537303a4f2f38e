"""One Tensor Fusion job: many small allreduces submitted at once, as a backward pass does.

Run under ``horovodrun -np 2 --gloo python docs/investigations/tensor-fusion/fusion_worker.py
--tensors 100 --elements 10240``. Each batch submits ``--tensors`` asynchronous in-place float32 sums of
``--elements`` each (40 KB by default) and waits for all of them; rank 0 prints one JSON line with
the median seconds per batch over ``--batches`` timed batches (after ``--warmup`` untimed ones)
and the fusion threshold in force. Whether Horovod fuses them into one buffer is decided by
``HOROVOD_FUSION_THRESHOLD`` in the environment (0 turns fusion off), read once at ``hvd.init``,
which is why on and off are separate jobs (``fusion.py`` interleaves them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import horovod.torch as hvd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # the shared workload
import workload


def batch(tensors: list[torch.Tensor]) -> None:
    """Submits every tensor's allreduce, then waits for all: Horovod sees them in one cycle."""
    handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"fusion.{i}")
               for i, t in enumerate(tensors)]
    for handle in handles:
        hvd.synchronize(handle)


def check(tensors: list[torch.Tensor]) -> None:
    """Ones summed over the ranks must give the world size in every tensor."""
    for t in tensors:
        t.fill_(1.0)
    batch(tensors)
    if not all(bool(torch.all(t == hvd.size())) for t in tensors):
        raise SystemExit("wrong allreduce result")
    for t in tensors:
        t.zero_()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Tensor count and size, timed and untimed batches."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--elements", type=int, default=10240, help="float32 elements per tensor")
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Times the batches and prints the median on rank 0."""
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    tensors = [torch.zeros(args.elements) for _ in range(args.tensors)]
    check(tensors)
    times = []
    for index in range(args.warmup + args.batches):
        started = time.perf_counter()
        batch(tensors)
        if index >= args.warmup:
            times.append(time.perf_counter() - started)
    workload.report({"rank": hvd.rank(), "seconds_per_batch": statistics.median(times),
                     "tensors": args.tensors, "bytes_per_tensor": 4 * args.elements,
                     "fusion_threshold": os.environ.get("HOROVOD_FUSION_THRESHOLD", "default")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
