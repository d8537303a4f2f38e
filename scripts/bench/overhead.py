"""Trainer overhead: hvdtrain's PyTorch or TensorFlow trainer against a hand-written Horovod loop.

Both workers train the same MLP on the same digits split with the same batch, optimizer and epochs
under ``horovodrun -np 2``; each reports its training wall time (first step through the final
evaluation and checkpoint) divided by its optimizer steps. The hand-written loop of the chosen
framework (``handwritten_torch.py`` or ``handwritten_tf.py``) runs twice per round, as the baseline
A and as the A/A control A', interleaved with hvdtrain (B, ``hvdtrain_worker.py``). Target: the
ratio of medians B/A is at most 1.03, measured where the A/A control A'/A is within 1% of 1.

Usage (from the repository root)::

    .venv/bin/python scripts/bench/overhead.py                 # PyTorch, appends to docs/benchmarks.md
    .venv/bin/python scripts/bench/overhead.py --framework tensorflow
    .venv/bin/python scripts/bench/overhead.py --quick --no-write   # a tiny end-to-end check
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Sequence

import harness
import launch
from harness import Row
from launch import Job, Results, Sizes

KEY = "step_time_s"
TARGET_RATIO = 1.03
AA_TOLERANCE = 0.01

BASELINE, CANDIDATE, CONTROL = "handwritten (A)", "hvdtrain (B)", "handwritten (A', A/A control)"

FULL = Sizes(rounds=6, epochs=10, warmup=1)
QUICK = Sizes(rounds=1, epochs=1, warmup=0)


@dataclass(frozen=True)
class Framework:
    """What differs between the frameworks' overhead benchmarks."""

    title: str
    handwritten: str
    """The hand-written loop's worker script."""
    note: str
    """What the reader must know about this framework's two sides beyond the common notes."""


FRAMEWORKS = {
    "torch": Framework(
        "PyTorch", "handwritten_torch.py",
        "Hand-written side: `hvd.DistributedOptimizer`, `DistributedSampler` order, batches cut by "
        "tensor indexing, one `torch.save` on rank 0."),
    "tensorflow": Framework(
        "TensorFlow", "handwritten_tf.py",
        "Hand-written side: a `tf.function` step on `hvd.DistributedGradientTape` with a fixed "
        "input signature (one trace, inside the timed region, as hvdtrain's), an eager evaluation "
        "(hvdtrain evaluates through a `tf.function`, so its timed region also holds that trace), "
        "one `np.savez` on rank 0."),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--quick`` changes the defaults of rounds, epochs and warm-up only."""
    parser = launch.make_parser(__doc__.splitlines()[0], FULL, QUICK)
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), default="torch",
                        help="whose trainer and hand-written loop to compare (default torch)")
    return launch.parse_args(parser, argv, FULL, QUICK)


def jobs(framework: str) -> list[Job]:
    """The three interleaved jobs: A, B and A'."""
    handwritten = FRAMEWORKS[framework].handwritten
    return [Job(BASELINE, handwritten),
            Job(CANDIDATE, "hvdtrain_worker.py", ("--framework", framework)),
            Job(CONTROL, handwritten)]


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


def notes(args: argparse.Namespace, results: Results, rows: Sequence[Row]) -> list[str]:
    """The lines under the table: workload, what is timed, that both sides learn alike, the verdict."""
    return [
        launch.workload_note(args, results[BASELINE][0]["steps"]),
        "Step time = the run's training wall time (first step through the final evaluation and "
        "checkpoint; process start, imports and `hvd.init` excluded) / optimizer steps, on rank 0.",
        FRAMEWORKS[args.framework].note,
        launch.accuracy_note(results),
        f"Result: {verdict(rows)}.",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints the section and, unless ``--no-write``, appends it to the doc."""
    args = parse_args(argv)
    machine, results = launch.run(jobs(args.framework), args, KEY)
    rows = harness.summarize(harness.samples_of(results, KEY), baseline=BASELINE)
    title = (f"Trainer overhead: hvdtrain {FRAMEWORKS[args.framework].title} trainer vs a "
             "hand-written Horovod loop (step time)")
    command = launch.reproduce_command("overhead.py", args, ("--framework", args.framework))
    launch.publish(harness.markdown_section(title, command, machine, rows, notes(args, results, rows)),
                   args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
