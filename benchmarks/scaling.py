"""Scaling: hvdtrain's samples/s at 1 and 2 processes, one compute thread each, ResNet-18.

Four jobs a round (``resnet_worker.py --threads 1``), interleaved by job: hvdtrain at
``horovodrun -np 1`` (A), ``-np 2`` (B), the host's ceiling (C: two processes running the same
steps without any communication, ``--trainer alone``) and ``-np 1`` again (A', the A/A control),
the batch per rank fixed (weak scaling). Efficiency = tput(2) / (2 x tput(1)) = B/A / 2. Target
>= 0.9.

Usage (from the repository root)::

    .venv/bin/python benchmarks/scaling.py
    .venv/bin/python benchmarks/scaling.py --quick --no-write     # a tiny end-to-end check
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import harness
import resnet_worker as rw

KEY = "samples_per_s"
TARGET = 0.9
ONE, TWO, CONTROL = "1 process (A)", "2 processes (B)", "1 process (A', A/A control)"
CEILING = "2 processes, no communication (C)"


def jobs(args: argparse.Namespace) -> list[harness.Job]:
    """A, B, C and A', one thread a process."""
    env = harness.env_pairs(args.env)

    def at(name: str, np: int, trainer: str = "hvdtrain") -> harness.Job:
        return harness.Job(name, rw.job_argv(rw.horovodrun(np), args, trainer, threads=1), env)

    return [at(ONE, 1), at(TWO, 2), at(CEILING, 2, "alone"), at(CONTROL, 1)]


def efficiency(rows: Sequence[harness.Row]) -> harness.Verdict:
    """B/A / 2 judged against the target beside the A/A control."""
    named = harness.by_name(rows)
    return harness.judge(named[TWO].ratio / 2, named[CONTROL].ratio, TARGET, higher_is_better=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the jobs, prints the section and, unless ``--no-write``, writes it."""
    p = harness.parser("scaling.py", __doc__.splitlines()[0], rw.SIZES, timeout=600.0)
    rw.driver_options(p)
    args = harness.parse(p, argv)
    machine = harness.machine_record()
    results = harness.run_jobs(jobs(args), args.rounds, args.warmup, KEY, args.timeout)
    rows = harness.summarize(harness.samples_of(results, KEY), ONE)
    named = harness.by_name(rows)
    notes = [
        rw.driver_note(args),
        "One compute thread a process (`train.threads=1`); Horovod's background thread and "
        "Gloo's I/O come on top. Over Gloo.",
        f"Result, efficiency tput(2) / (2 x tput(1)): {efficiency(rows)}.",
        f"The host's ceiling C/A / 2 = {named[CEILING].ratio / 2:.3f}; hvdtrain kept "
        f"{named[TWO].median / named[CEILING].median:.3f} of it (B/C).",
    ]
    fmt = {"unit": "samples/s", "scale": 1.0, "digits": 1}
    entry = harness.Entry(label="Scaling", script="scaling.py",
                          target=f"2 x time per sample at 2 processes / at 1 <= {1 / TARGET:.3f} "
                                 f"(efficiency >= {TARGET})",
                          verdict=harness.brief(efficiency(rows)))
    harness.publish(harness.section_text(
        "Scaling: hvdtrain at 1 vs 2 processes, ResNet-18, one thread each (samples/s)",
        args.command, machine, [harness.table_block("", rows, **fmt)], notes, entry=entry), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
