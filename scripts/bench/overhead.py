"""Trainer overhead: hvdtrain's PyTorch trainer against a hand-written Horovod loop.

Both workers train the same MLP on the same digits split with the same batch, optimizer and epochs
under ``horovodrun -np 2``; each reports its training wall time (first step through the final
evaluation and checkpoint) divided by its optimizer steps. The hand-written loop runs twice per
round, as the baseline A and as the A/A control A', interleaved with hvdtrain (B). Target: the ratio
of medians B/A is at most 1.03, measured where the A/A control A'/A is within 1% of 1.

Usage (from the repository root)::

    .venv/bin/python scripts/bench/overhead.py                 # full run, appends to docs/benchmarks.md
    .venv/bin/python scripts/bench/overhead.py --quick --no-write   # a tiny end-to-end check
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import harness
from harness import Command, Row

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KEY = "step_time_s"
TARGET_RATIO = 1.03
AA_TOLERANCE = 0.01

BASELINE, CANDIDATE, CONTROL = "handwritten (A)", "hvdtrain (B)", "handwritten (A', A/A control)"
WORKERS = {BASELINE: "handwritten_torch.py", CANDIDATE: "hvdtrain_torch.py",
           CONTROL: "handwritten_torch.py"}

FULL = {"rounds": 6, "epochs": 10, "warmup": 1}
QUICK = {"rounds": 1, "epochs": 1, "warmup": 0}

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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--quick`` changes the defaults of rounds, epochs and warm-up only."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help=f"measured rounds (default {FULL['rounds']})")
    parser.add_argument("--epochs", type=int, help=f"epochs per run (default {FULL['epochs']})")
    parser.add_argument("--warmup", type=int, help=f"discarded rounds first (default {FULL['warmup']})")
    parser.add_argument("--np", type=int, default=2, help="ranks per run (default 2)")
    parser.add_argument("--controller", choices=("gloo", "mpi"), default="gloo")
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny check: defaults {QUICK} instead of {FULL}")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    args = parser.parse_args(argv)
    for name, default in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.rounds < 1 or args.epochs < 1 or args.warmup < 0 or args.np < 1:
        parser.error("--rounds, --epochs and --np must be positive and --warmup not negative")
    return args


def python() -> Path:
    """This interpreter's absolute path, symlinks kept: ``.venv/bin/python`` must stay the venv's."""
    return Path(os.path.abspath(sys.executable))


def horovodrun() -> str:
    """The ``horovodrun`` next to this interpreter (the project's .venv), else the one on PATH."""
    local = python().parent / "horovodrun"
    found = str(local) if local.exists() else shutil.which("horovodrun")
    if not found:
        raise SystemExit("overhead.py: horovodrun not found; run `make setup` first")
    return found


def commands(args: argparse.Namespace, work: Path) -> list[Command]:
    """The three interleaved jobs: A, B and A'. Each writes its checkpoint to its own directory."""
    launch = [horovodrun(), "-np", str(args.np), f"--{args.controller}", str(python())]
    return [Command(name, launch + [str(HERE / script), "--epochs", str(args.epochs),
                                    "--out-dir", str(work / f"run{i}")])
            for i, (name, script) in enumerate(WORKERS.items())]


def worker_env() -> dict[str, str]:
    """The environment of the jobs: Open MPI refuses to start as root without these two."""
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that repeats this benchmark, with every setting spelled out."""
    interpreter = python()
    if interpreter.is_relative_to(ROOT):
        interpreter = interpreter.relative_to(ROOT)
    argv = [str(interpreter), "scripts/bench/overhead.py", "--rounds", str(args.rounds),
            "--epochs", str(args.epochs), "--warmup", str(args.warmup), "--np", str(args.np),
            "--controller", args.controller]
    return shlex.join(argv)


def verdict(rows: Sequence[Row]) -> str:
    """Whether the target is met, missed, or cannot be judged because the A/A control is too noisy."""
    by_name = {row.name: row for row in rows}
    ratio, control = by_name[CANDIDATE].ratio, by_name[CONTROL].ratio
    head = f"hvdtrain / hand-written = {ratio:.3f}, A/A control = {control:.3f}"
    if abs(control - 1.0) > AA_TOLERANCE:
        return (f"{head}: inconclusive, the A/A control is off by more than "
                f"{AA_TOLERANCE:.0%}, so the machine was too noisy to judge a {TARGET_RATIO} target")
    met = "met" if ratio <= TARGET_RATIO else "missed"
    return f"{head}: target (ratio <= {TARGET_RATIO} with A/A within {AA_TOLERANCE:.0%}) {met}"


def notes(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]],
          rows: Sequence[Row]) -> list[str]:
    """The lines under the table: workload, what is timed, that both sides learn alike, the verdict."""
    steps = results[BASELINE][0]["steps"]
    accuracy = ", ".join(f"{name} {statistics.median(m['eval_accuracy'] for m in runs):.3f}"
                         for name, runs in results.items())
    return [
        f"Workload: digits MLP (64-128-10), `horovodrun -np {args.np} --{args.controller}`, "
        f"batch 32 per rank, SGD lr 0.05 x {args.np} momentum 0.9; per run {args.epochs} "
        f"epoch(s), {steps} steps; rounds: {args.rounds} measured after {args.warmup} warm-up.",
        "Step time = the run's training wall time (first step through the final evaluation and "
        "checkpoint; process start, imports and `hvd.init` excluded) / optimizer steps, on rank 0.",
        f"Median final test accuracy (both sides train the same problem): {accuracy}.",
        f"Result: {verdict(rows)}.",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints the section and, unless ``--no-write``, appends it to the doc."""
    args = parse_args(argv)
    # Taken before the runs, so that the load average shows what else the machine was doing.
    machine = harness.machine_record()
    with tempfile.TemporaryDirectory(prefix="hvdtrain-overhead-") as work:
        results = harness.run_interleaved(commands(args, Path(work)), args.rounds, KEY,
                                          warmup_rounds=args.warmup, env=worker_env(),
                                          timeout=args.timeout)
    rows = harness.summarize(harness.samples_of(results, KEY), baseline=BASELINE)
    section = harness.markdown_section(
        "Trainer overhead: hvdtrain PyTorch trainer vs a hand-written Horovod loop (step time)",
        reproduce_command(args), machine, rows, notes(args, results, rows))
    print(section)
    if not args.no_write:
        harness.append_markdown(args.output, section, HEADER)
        print(f"[bench] appended to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
