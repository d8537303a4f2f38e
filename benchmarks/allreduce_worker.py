"""One allreduce-bandwidth job: Horovod against its raw backend and a memory copy, interleaved.

Run under ``horovodrun -np 2 --gloo`` (Horovod's Gloo ops against raw ``torch.distributed`` Gloo)
or ``horovodrun -np 2 --mpi`` (Horovod's MPI ops against raw ``mpi4py`` ``Allreduce``). For every
message size, every round runs each variant once, in the order raw (A), Horovod (B), raw again
(A', the A/A control) and the memory copy (C), reversed on odd rounds (``harness.round_order``).
A run is ``iters`` back-to-back in-place sums of a float32 buffer of that size after a barrier,
timed on rank 0; rank 0 prints one JSON line per run with ``size``, ``round``, ``slot``,
``variant``, ``seconds`` (per operation) and ``algbw_GBps`` (bytes / seconds, nccl-tests' algorithm
bandwidth). The memory copy is ``numpy.copyto`` of a buffer of the same size, done by both ranks at
once, as a ceiling for what the machine's memory moves in the same run.

Every variant's result is checked once per size before it is timed (ones summed over the ranks
must give the world size), so a fast but wrong variant cannot pass.
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType

import horovod.torch as hvd
import numpy as np
import torch
import torch.distributed as dist

import harness
import workload

Op = Callable[[], None]

# Open MPI's launcher sets this; under horovodrun --gloo it is absent.
CONTROLLER = "mpi" if "OMPI_COMM_WORLD_SIZE" in os.environ else "gloo"


def load_mpi() -> ModuleType | None:
    """``mpi4py.MPI`` in the MPI job, before ``hvd.init``; ``None`` in the Gloo job.

    Imported first, mpi4py initialises MPI with MPI_THREAD_MULTIPLE, which Horovod accepts when it
    finds MPI running. In the Gloo job it must not be imported at all: each rank would start an MPI
    singleton of its own, and Horovod would then run on that, one rank per world.
    """
    return importlib.import_module("mpi4py.MPI") if CONTROLLER == "mpi" else None


MPI = load_mpi()


class Variant:
    """A named in-place operation on one buffer of ``size`` bytes, and how to wait for all ranks."""

    def __init__(self, name: str, op: Op, barrier: Op, check: Callable[[], bool]) -> None:
        self.name, self.op, self.barrier, self.check = name, op, barrier, check


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_torch_gloo() -> None:
    """Starts ``torch.distributed`` over Gloo on loopback; rank 0 picks the port, tells the rest."""
    # A fixed name: the default (the type's name) would differ between int on rank 0 and None.
    port = hvd.broadcast_object(_free_port() if hvd.rank() == 0 else None, root_rank=0,
                                name="bench.port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(),
                            world_size=hvd.size())


def _checked(buffer: torch.Tensor, op: Op) -> Callable[[], bool]:
    def check() -> bool:
        buffer.fill_(1.0)
        op()
        ok = bool(torch.all(buffer == hvd.size()))
        buffer.zero_()  # zeros stay zeros under summing: no overflow, no denormals while timed
        return ok
    return check


def variants(controller: str, elements: int) -> list[Variant]:
    """Raw backend (A), Horovod (B), raw again (A') and the memory copy (C) for one size."""
    tensor = torch.zeros(elements, dtype=torch.float32)
    array = tensor.numpy()  # the same memory, for mpi4py and the copy
    # Written, not only allocated: untouched pages all map to the kernel's one zero page, and
    # copying from that would measure the cache, not memory.
    source = np.empty_like(array)
    source.fill(0.0)

    def horovod() -> None:
        hvd.allreduce_(tensor, op=hvd.Sum, name="bench.allreduce")

    if controller == "gloo":
        def raw() -> None:
            dist.all_reduce(tensor)
        raw_name, raw_barrier = "torch.distributed gloo", dist.barrier
    else:
        def raw() -> None:
            MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        raw_name, raw_barrier = "mpi4py Allreduce", MPI.COMM_WORLD.Barrier

    def copy() -> None:
        np.copyto(array, source)

    copy_check = lambda: (copy(), bool(np.all(array == 0)))[1]  # noqa: E731
    return [Variant(f"{raw_name} (A)", raw, raw_barrier, _checked(tensor, raw)),
            Variant(f"Horovod {controller} (B)", horovod, hvd.barrier, _checked(tensor, horovod)),
            Variant(f"{raw_name} (A', A/A control)", raw, raw_barrier, _checked(tensor, raw)),
            Variant("memory copy (C)", copy, hvd.barrier, copy_check)]


def iterations(size: int, budget: int, cap: int) -> int:
    """Operations per timed run: about ``budget`` bytes in all, between 1 and ``cap``."""
    return max(1, min(cap, budget // size))


def time_run(variant: Variant, iters: int) -> float:
    """Seconds per operation of ``iters`` back-to-back operations after a barrier."""
    variant.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        variant.op()
    return (time.perf_counter() - started) / iters


def measure_size(controller: str, size: int, rounds: int, warmup: int, budget: int,
                 cap: int) -> None:
    """Checks, warms and times every variant at one size; rank 0 prints each run."""
    chosen = variants(controller, size // 4)
    bad = [v.name for v in chosen if not v.check()]
    if bad:
        raise SystemExit(f"wrong allreduce result at {size} bytes: {', '.join(bad)}")
    iters = iterations(size, budget, cap)
    slots = list(enumerate(chosen))
    for round_index in range(-warmup, rounds):
        for slot, variant in harness.round_order(slots, round_index):
            seconds = time_run(variant, iters)
            workload.report({"rank": hvd.rank(), "size": size, "round": round_index, "slot": slot,
                             "variant": variant.name, "iters": iters, "seconds": seconds,
                             "algbw_GBps": size / seconds / 1e9})


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Sizes, rounds, warm-up rounds and the bytes each timed run should move."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget", type=int, default=64 << 20,
                        help="bytes per timed run (iterations = budget / size, 1 to --max-iters)")
    parser.add_argument("--max-iters", type=int, default=100)
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs every size in turn, small to large."""
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)  # the reductions here are the libraries' own, not torch's kernels
    if CONTROLLER == "gloo":
        init_torch_gloo()
    for size in args.sizes:
        measure_size(CONTROLLER, size, args.rounds, args.warmup, args.budget, args.max_iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
