"""Tensor Fusion: 100 allreduces of 40 KB submitted at once, fusion on against off.

Each variant is a ``horovodrun -np 2`` job of its own (``fusion_worker.py``), since Horovod reads
``HOROVOD_FUSION_THRESHOLD`` once, at ``hvd.init``: fusion on (Horovod's default threshold, A),
off (``HOROVOD_FUSION_THRESHOLD=0``, B) and on again (A', the A/A control), interleaved by job.
A job's figure is its median time per batch of 100 tensors. No target: a comparison.

It measures Horovod itself, not hvdtrain, so it lives with its note
(``docs/investigations/tensor-fusion.md``, where it writes its section by default); the harness
stays in ``benchmarks/``.

Usage (from the repository root)::

    .venv/bin/python docs/investigations/tensor-fusion/fusion.py
    .venv/bin/python docs/investigations/tensor-fusion/fusion.py --quick --no-write  # a tiny end-to-end check
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the harness
import harness  # noqa: E402

NOTE = ROOT / "docs" / "investigations" / "tensor-fusion.md"
"""Where a run writes its section (``--output`` by default)."""

KEY = "seconds_per_batch"
BASELINE, CANDIDATE = "fusion on (A)", "fusion off, threshold 0 (B)"
CONTROL = "fusion on (A', A/A control)"
SIZES = {"rounds": (5, 1), "warmup": (1, 0), "batches": (30, 3)}


def jobs(args: argparse.Namespace) -> list[harness.Job]:
    """A, B and A': the same worker, B with fusion turned off."""
    argv = [harness.horovodrun(), "-np", str(args.np), f"--{args.controller}",
            str(harness.python()), str(HERE / "fusion_worker.py"), "--tensors",
            str(args.tensors), "--elements", str(args.elements), "--batches", str(args.batches)]
    return [harness.Job(BASELINE, argv, {}),
            harness.Job(CANDIDATE, argv, {"HOROVOD_FUSION_THRESHOLD": "0"}),
            harness.Job(CONTROL, argv, {})]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the jobs, prints the section and, unless ``--no-write``, writes it."""
    p = harness.parser(Path(__file__), __doc__.splitlines()[0], SIZES, timeout=300.0)
    p.set_defaults(output=NOTE)
    p.add_argument("--tensors", type=int, default=100)
    p.add_argument("--elements", type=int, default=10240, help="float32 per tensor (40 KB)")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--controller", choices=("gloo", "mpi"), default="gloo")
    args = harness.parse(p, argv)
    machine = harness.machine_record()
    results = harness.run_jobs(jobs(args), args.rounds, args.warmup, KEY, args.timeout)
    rows = harness.summarize(harness.samples_of(results, KEY), BASELINE)
    named, kb = harness.by_name(rows), 4 * args.elements / 1024
    notes = [
        f"Workload: {args.tensors} tensors of {kb:g} KB, all submitted with `allreduce_async_` "
        f"then awaited, {args.batches} timed batches a job (its median); `horovodrun -np "
        f"{args.np} --{args.controller}`; {args.rounds} rounds after {args.warmup} warm-up.",
        "Fusion on: Horovod's default `HOROVOD_FUSION_THRESHOLD` and cycle time, so the tensors "
        "of one cycle travel in one buffer; off: each tensor is its own allreduce.",
        f"Result: fusion off / fusion on = {named[CANDIDATE].ratio:.3f} (time per batch; above 1, "
        f"fusion saves time), A/A control = {named[CONTROL].ratio:.3f}.",
    ]
    harness.publish(harness.section_text(
        f"Tensor Fusion: {args.tensors} x {kb:g} KB allreduces, fusion on vs off (time per batch)",
        args.command, machine, [harness.table_block("", rows)], notes), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
