"""Scaling: hvdtrain's samples/s at 1 and 2 processes, one compute thread each, ResNet-18.

Four jobs per round (``resnet_worker.py --threads 1``), interleaved by job (``launch.run_jobs``):
hvdtrain at ``horovodrun -np 1`` (A), ``-np 2`` (B) and ``-np 1`` again (A', the A/A control), the
batch per rank fixed (weak scaling), and the host's ceiling (C): two processes running the same
steps without any communication (``--trainer alone``). Efficiency = throughput(2) / (2 x
throughput(1)) = the B/A ratio of medians / 2. Target >= 0.9. B/C is the part of what the host
gives two processes that hvdtrain keeps once gradients are exchanged.

Usage (from the repository root)::

    .venv/bin/python scripts/bench/scaling.py                      # writes its section of docs/benchmarks.md
    .venv/bin/python scripts/bench/scaling.py --quick --no-write     # a tiny end-to-end check
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import harness
import launch

KEY = "samples_per_s"
ONE, TWO, CONTROL = "1 process (A)", "2 processes (B)", "1 process (A', A/A control)"
CEILING = "2 processes, no communication (C)"
TARGET = 0.9


def jobs(args: argparse.Namespace) -> list[launch.Job]:
    """A, B, C and A': hvdtrain at 1, 2 and 1 processes and the ceiling, one thread each."""
    def at(np: int, trainer: str = "hvdtrain") -> list[str]:
        return launch.resnet_argv([launch.horovodrun(), "-np", str(np), "--gloo",
                                   str(launch.python())], args, trainer, threads=1)
    env = args.horovod_env
    return [launch.Job(ONE, at(1), env), launch.Job(TWO, at(2), env),
            launch.Job(CEILING, at(2, "alone"), env), launch.Job(CONTROL, at(1), env)]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the jobs, prints the section and, unless ``--no-write``, writes it to the doc."""
    return launch.resnet_benchmark(__doc__.splitlines()[0], jobs, section, KEY, argv)


def section(args: argparse.Namespace, machine: dict[str, Any], results: launch.Results) -> str:
    """The Markdown section of measured ``results``."""
    rows = harness.summarize(harness.samples_of(results, KEY), baseline=ONE)
    by_name = {row.name: row for row in rows}
    efficiency, control = by_name[TWO].ratio / 2, by_name[CONTROL].ratio
    notes = [
        launch.resnet_note(args),
        "One compute thread per process (`train.threads=1`), so 2 processes use 2 cores where "
        "1 process uses one; Horovod's background thread and Gloo's I/O come on top. Over Gloo.",
        f"Result: efficiency = tput(2) / (2 x tput(1)) = {efficiency:.3f} against A "
        f"({efficiency / control:.3f} against A'), target >= {TARGET}: "
        f"{harness.judge(efficiency >= TARGET, control)}; A/A control = {control:.3f}.",
        f"The host's ceiling: two processes without any communication reached "
        f"{by_name[CEILING].ratio / 2:.3f} of twice one process (C/A / 2); hvdtrain's 2-process "
        f"job kept {by_name[TWO].median / by_name[CEILING].median:.3f} of that ceiling (B/C).",
    ]
    return harness.markdown_section(
        "Scaling: hvdtrain at 1 vs 2 processes, ResNet-18, one thread each (samples/s)",
        launch.resnet_command("scaling.py", args), machine, rows, notes, unit="samples/s",
        scale=1.0, digits=1)


if __name__ == "__main__":
    sys.exit(main())
