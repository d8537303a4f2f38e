"""hvdtrain against PyTorch DDP: the same ResNet-18, data, batch and optimizer at 2 processes.

Five jobs a round (``resnet_worker.py``), interleaved by job: DDP under ``torchrun --standalone``
over Gloo (A, the baseline), hvdtrain under ``horovodrun --gloo`` (B) and ``--mpi`` (C), a
hand-written Horovod loop under ``horovodrun --gloo`` (D), and DDP again (A', the A/A control).
Figure: samples/s on rank 0 over the steady steps. Target: hvdtrain >= 1.0x DDP.

Usage (from the repository root)::

    .venv/bin/python benchmarks/ddp.py
    .venv/bin/python benchmarks/ddp.py --quick --no-write     # a tiny end-to-end check
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

import harness
import resnet_worker as rw

KEY = "samples_per_s"
TARGET = 1.0
BASELINE, CONTROL = "DDP torchrun gloo (A)", "DDP torchrun gloo (A', A/A control)"
GLOO, MPI = "hvdtrain horovodrun gloo (B)", "hvdtrain horovodrun mpi (C)"
HANDWRITTEN = "hand-written Horovod horovodrun gloo (D)"


def jobs(args: argparse.Namespace, np: int = 2) -> list[harness.Job]:
    """A, B, C, D and A'."""
    torchrun = [str(harness.python().parent / "torchrun"), "--standalone", f"--nproc-per-node={np}"]
    ddp, env = rw.job_argv(torchrun, args, "ddp"), harness.env_pairs(args.env)
    return [harness.Job(BASELINE, ddp, {}),
            harness.Job(GLOO, rw.job_argv(rw.horovodrun(np), args, "hvdtrain"), env),
            harness.Job(MPI, rw.job_argv(rw.horovodrun(np, "mpi"), args, "hvdtrain"), env),
            harness.Job(HANDWRITTEN, rw.job_argv(rw.horovodrun(np), args, "horovod"), env),
            harness.Job(CONTROL, ddp, {})]


def verdicts(rows: Sequence[harness.Row]) -> dict[str, harness.Verdict]:
    """Each hvdtrain variant's ratio to DDP judged against the target beside the A/A control."""
    named = harness.by_name(rows)
    return {name: harness.judge(named[name].ratio, named[CONTROL].ratio, TARGET,
                                higher_is_better=True) for name in (GLOO, MPI)}


def phases_note(results: harness.Results) -> str:
    """The median of each part of a step (rank 0's per-job medians) for the hand-written loops."""
    parts = []
    for name in (BASELINE, HANDWRITTEN, CONTROL):
        medians = {phase: statistics.median(r["phases_ms"][phase] for r in results[name])
                   for phase in rw.PHASES}
        parts.append(f"{name.split(' (')[0]} {' / '.join(f'{v:.1f}' for v in medians.values())}"
                     + (" (A/A)" if name == CONTROL else ""))
    return (f"Parts of a step, median ms ({' / '.join(rw.PHASES)}; DDP waits for its last buckets "
            f"inside its backward pass): {'; '.join(parts)}.")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the jobs, prints the section and, unless ``--no-write``, writes it."""
    p = harness.parser("ddp.py", __doc__.splitlines()[0], rw.SIZES, timeout=600.0)
    rw.driver_options(p)
    args = harness.parse(p, argv)
    machine = harness.machine_record()
    results = harness.run_jobs(jobs(args), args.rounds, args.warmup, KEY, args.timeout)
    rows = harness.summarize(harness.samples_of(results, KEY), BASELINE)
    named = harness.by_name(rows)
    notes = [
        rw.driver_note(args),
        "DDP: `DistributedDataParallel` defaults (25 MB buckets overlapping the backward pass). "
        "hvdtrain: its own loop and engine (`hvd.DistributedOptimizer`, `comm.cycle_time_ms: 0`: "
        "Horovod's 1 ms), metrics allreduced every 10 steps, no checkpoint, no W&B or TensorBoard. "
        "Hand-written Horovod: the DDP loop with `hvd.DistributedOptimizer` at Horovod's defaults.",
        *[f"Result, {name.split(' (')[0]} / DDP: {v}." for name, v in verdicts(rows).items()],
        f"Hand-written Horovod / DDP = {named[HANDWRITTEN].ratio:.3f}; hvdtrain gloo / "
        f"hand-written Horovod = {named[GLOO].median / named[HANDWRITTEN].median:.3f}.",
        phases_note(results),
    ]
    fmt = {"unit": "samples/s", "scale": 1.0, "digits": 1}
    judged = "; ".join(f"over {'Gloo' if name == GLOO else 'MPI'} {harness.brief(v, named[name])}"
                       for name, v in verdicts(rows).items())
    entry = harness.Entry(
        label="hvdtrain vs PyTorch DDP", script="ddp.py",
        target=f"hvdtrain / DDP time per sample <= {1 / TARGET:.3g}",
        verdict=f"{judged}; {args.rounds} rounds; hvdtrain / the hand-written Horovod loop, time "
                f"per sample {named[HANDWRITTEN].median / named[GLOO].median:.3f}")
    harness.publish(harness.section_text(
        "hvdtrain vs PyTorch DDP: ResNet-18 on synthetic images, 2 processes (samples/s)",
        args.command, machine, [harness.table_block("", rows, **fmt)], notes, entry=entry), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
