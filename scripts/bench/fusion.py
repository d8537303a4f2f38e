"""Tensor Fusion: 100 allreduces of 40 KB submitted at once, fusion on against off.

Each variant is a ``horovodrun -np 2`` job of its own (``fusion_worker.py``), since Horovod reads
``HOROVOD_FUSION_THRESHOLD`` once, at ``hvd.init``: fusion on (Horovod's default threshold, A),
fusion off (``HOROVOD_FUSION_THRESHOLD=0``, B) and on again (A', the A/A control), interleaved
by job in rounds (``launch.run_jobs``). A job's figure is its median time per batch of 100
tensors; the table gives min, median and max over the rounds and the ratio of medians.

Usage (from the repository root)::

    .venv/bin/python scripts/bench/fusion.py                    # writes its section of docs/benchmarks.md
    .venv/bin/python scripts/bench/fusion.py --quick --no-write   # a tiny end-to-end check
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Sequence

import harness
import launch

KEY = "seconds_per_batch"
BASELINE, CANDIDATE = "fusion on (A)", "fusion off, threshold 0 (B)"
CONTROL = "fusion on (A', A/A control)"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--quick`` makes one round of short jobs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help="measured rounds (default 5)")
    parser.add_argument("--warmup", type=int, help="discarded rounds first (default 1)")
    parser.add_argument("--batches", type=int, help="timed batches per job (default 30)")
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--elements", type=int, default=10240, help="float32 per tensor (40 KB)")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--controller", choices=("gloo", "mpi"), default="gloo")
    parser.add_argument("--quick", action="store_true", help="tiny check: 1 round, 3 batches")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    parser.add_argument("--output", type=launch.Path,
                        default=launch.ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    args = parser.parse_args(argv)
    for name, full, quick in (("rounds", 5, 1), ("warmup", 1, 0), ("batches", 30, 3)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def jobs(args: argparse.Namespace) -> list[launch.Job]:
    """A, B and A': the same worker, B with fusion turned off."""
    argv = [launch.horovodrun(), "-np", str(args.np), f"--{args.controller}",
            str(launch.python()), str(launch.HERE / "fusion_worker.py"), "--tensors",
            str(args.tensors), "--elements", str(args.elements), "--batches", str(args.batches)]
    return [launch.Job(BASELINE, argv, {}),
            launch.Job(CANDIDATE, argv, {"HOROVOD_FUSION_THRESHOLD": "0"}),
            launch.Job(CONTROL, argv, {})]


def reproduce(args: argparse.Namespace) -> str:
    """The command line that repeats this benchmark."""
    return shlex.join([str(launch.reproduce_interpreter()), "scripts/bench/fusion.py",
                       "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--batches",
                       str(args.batches), "--tensors", str(args.tensors), "--elements",
                       str(args.elements), "--np", str(args.np), "--controller", args.controller])


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the jobs, prints the section and, unless ``--no-write``, writes it to the doc."""
    args = parse_args(argv)
    machine = harness.machine_record()
    results = launch.run_jobs(jobs(args), args.rounds, args.warmup, KEY, args.timeout)
    rows = harness.summarize(harness.samples_of(results, KEY), baseline=BASELINE)
    by_name = {row.name: row for row in rows}
    kb = 4 * args.elements / 1024
    notes = [
        f"Workload: {args.tensors} tensors of {kb:g} KB, all submitted with `allreduce_async_` and "
        f"then awaited, {args.batches} timed batches per job (median per job); "
        f"`horovodrun -np {args.np} --{args.controller}`; {args.rounds} rounds after "
        f"{args.warmup} warm-up.",
        "Fusion on: Horovod's default `HOROVOD_FUSION_THRESHOLD` (128 MB) and cycle time "
        "(1 ms), so the "
        "tensors of one cycle travel in one buffer; off: each tensor is its own allreduce.",
        f"Result: fusion off / fusion on = {by_name[CANDIDATE].ratio:.3f} (time per batch; above "
        f"1, fusion saves time), A/A control = {by_name[CONTROL].ratio:.3f}.",
    ]
    launch.publish(harness.markdown_section(
        f"Tensor Fusion: {args.tensors} x {kb:g} KB allreduces, fusion on vs off (time per batch)",
        reproduce(args), machine, rows, notes), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
