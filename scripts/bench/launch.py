"""What the benchmark drivers share: their common options, the Horovod jobs they start, the doc.

``overhead.py`` and ``frameworks.py`` each compare Horovod jobs through :mod:`harness`; this module
parses the options they share, finds ``horovodrun``, builds the jobs' command lines, runs them and
writes the resulting section to ``docs/benchmarks.md``. Like the harness, it imports no framework.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import harness
import workload
from harness import Command

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

HEADER = """# Benchmarks

Every table here comes from a script in `scripts/bench/`; each section gives the date, the command
that reproduces it (run from the repository root after `make setup`) and the machine.

Method (`scripts/bench/harness.py`): the compared commands run interleaved in rounds, one run of
each per round, in alternating order (A B A' in one round, A' B A in the next), after a discarded
warm-up round, so that a busy spell of the machine hits all of them alike. Every run is a fresh job
that measures itself and prints its result as JSON. The tables give min, median and max over the
rounds and each median's ratio to the baseline's median. A' is a second copy of the baseline A: its
ratio, the A/A control, shows how much two identical commands disagree on this machine, and a
difference smaller than that is noise, not a finding. Timings are never asserted in tests.
"""

Results = dict[str, list[dict[str, Any]]]
"""Each compared job's measurements, one per measured round (``harness.run_interleaved``)."""


@dataclass(frozen=True)
class Sizes:
    """How much a benchmark runs: measured rounds, epochs per job, discarded warm-up rounds."""

    rounds: int
    epochs: int
    warmup: int


@dataclass(frozen=True)
class Job:
    """One compared job: its table name, the worker script in this directory, the worker's options."""

    name: str
    script: str
    options: tuple[str, ...] = ()


def make_parser(description: str, full: Sizes, quick: Sizes) -> argparse.ArgumentParser:
    """A parser of the options every driver takes; a driver may add its own before parsing."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, help=f"measured rounds (default {full.rounds})")
    parser.add_argument("--epochs", type=int, help=f"epochs per run (default {full.epochs})")
    parser.add_argument("--warmup", type=int, help=f"discarded rounds first (default {full.warmup})")
    parser.add_argument("--np", type=int, default=2, help="ranks per run (default 2)")
    parser.add_argument("--controller", choices=("gloo", "mpi"), default="gloo")
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny check: defaults {quick} instead of {full}")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None, full: Sizes,
               quick: Sizes, *, min_epochs: int = 1) -> argparse.Namespace:
    """Parses ``argv``; ``--quick`` changes the defaults of rounds, epochs and warm-up only."""
    args = parser.parse_args(argv)
    for name, default in vars(quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.rounds < 1 or args.np < 1 or args.warmup < 0:
        parser.error("--rounds and --np must be positive and --warmup not negative")
    if args.epochs < min_epochs:
        parser.error(f"--epochs must be at least {min_epochs}")
    return args


def python() -> Path:
    """This interpreter's absolute path, symlinks kept: ``.venv/bin/python`` must stay the venv's."""
    return Path(os.path.abspath(sys.executable))


def horovodrun() -> str:
    """The ``horovodrun`` next to this interpreter (the project's .venv), else the one on PATH."""
    local = python().parent / "horovodrun"
    found = str(local) if local.exists() else shutil.which("horovodrun")
    if not found:
        raise SystemExit("horovodrun not found; run `make setup` first")
    return found


def commands(jobs: Sequence[Job], args: argparse.Namespace, work: Path) -> list[Command]:
    """The jobs' command lines under ``horovodrun``; each writes to its own directory in ``work``."""
    launch = [horovodrun(), "-np", str(args.np), f"--{args.controller}", str(python())]
    return [Command(job.name, launch + [str(HERE / job.script), *job.options,
                                        "--epochs", str(args.epochs), "--out-dir", str(work / f"run{i}")])
            for i, job in enumerate(jobs)]


def worker_env() -> dict[str, str]:
    """The environment of the jobs: Open MPI refuses to start as root without these two."""
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def run(jobs: Sequence[Job], args: argparse.Namespace, key: str) -> tuple[dict[str, Any], Results]:
    """Runs the jobs interleaved and returns the machine record and every job's measurements."""
    # Taken before the runs, so that the load average shows what else the machine was doing.
    machine = harness.machine_record()
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as work:
        results = harness.run_interleaved(commands(jobs, args, Path(work)), args.rounds, key,
                                          warmup_rounds=args.warmup, env=worker_env(),
                                          timeout=args.timeout)
    return machine, results


def reproduce_command(script: str, args: argparse.Namespace, extra: Sequence[str] = ()) -> str:
    """The command line that repeats a driver's benchmark, with every setting spelled out."""
    interpreter = python()
    if interpreter.is_relative_to(ROOT):
        interpreter = interpreter.relative_to(ROOT)
    argv = [str(interpreter), f"scripts/bench/{script}", *extra, "--rounds", str(args.rounds),
            "--epochs", str(args.epochs), "--warmup", str(args.warmup), "--np", str(args.np),
            "--controller", args.controller]
    return shlex.join(argv)


def workload_note(args: argparse.Namespace, steps: int) -> str:
    """The note that says what every job trained and how many runs the table holds."""
    return (f"Workload: digits MLP (64-{workload.HIDDEN}-10), `horovodrun -np {args.np} "
            f"--{args.controller}`, batch {workload.BATCH_SIZE} per rank, SGD lr {workload.BASE_LR} "
            f"x {args.np} momentum {workload.MOMENTUM}; per run {args.epochs} epoch(s), {steps} "
            f"steps; rounds: {args.rounds} measured after {args.warmup} warm-up.")


def accuracy_note(results: Results) -> str:
    """The note that shows every job learned the same problem: its median final test accuracy."""
    accuracy = ", ".join(f"{name} {statistics.median(m['eval_accuracy'] for m in runs):.3f}"
                         for name, runs in results.items())
    return f"Median final test accuracy (all jobs train the same problem): {accuracy}."


def publish(section: str, args: argparse.Namespace) -> None:
    """Prints ``section`` and, unless ``--no-write``, appends it to the output document."""
    print(section)
    if not args.no_write:
        harness.append_markdown(args.output, section, HEADER)
        print(f"[bench] appended to {args.output}", file=sys.stderr)
