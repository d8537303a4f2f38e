"""Trainer overhead: hvdtrain's PyTorch or TensorFlow trainer against a hand-written Horovod loop.

Both sides train the same MLP on the same digits split with the same batch, optimizer and epochs,
all runs in one ``horovodrun -np 2`` job (``interleaved.py``); each run reports two step times: its
training wall time (first step through the final evaluation and checkpoint) divided by its
optimizer steps, and its steady state (epochs 2 to N, up to the final evaluation; see
``workload.Clock``) divided by the steps in it. The second matters for TensorFlow, whose first step
traces a ``tf.function`` for seconds. The hand-written loop of the chosen framework
(``handwritten_torch.py`` or ``handwritten_tf.py``) runs twice per round, as the baseline A and as
the A/A control A', interleaved with hvdtrain (B, ``hvdtrain_worker.py``); the job loads only the
chosen framework's Horovod. Target: the ratio of medians B/A is at most 1.03, measured where the
A/A control A'/A is within 1% of 1.

Usage (from the repository root)::

    .venv/bin/python scripts/bench/overhead.py                       # PyTorch, writes its section of the doc
    .venv/bin/python scripts/bench/overhead.py --framework tensorflow  # TensorFlow, its own section
    .venv/bin/python scripts/bench/overhead.py --quick --no-write     # a tiny end-to-end check
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Sequence

import launch
from harness import Row
from launch import Results, Sizes, Variant

TARGET_RATIO = 1.03
AA_TOLERANCE = 0.01

BASELINE, CANDIDATE, CONTROL = "handwritten (A)", "hvdtrain (B)", "handwritten (A', A/A control)"

# Many short runs: the median of many settles better than that of a few long ones, and the whole
# benchmark stays within about 6 minutes on a 2-core machine.
FULL = Sizes(rounds=60, epochs=4, warmup=1)
# Two epochs: the steady state leaves the first one out and needs one more.
QUICK = Sizes(rounds=1, epochs=2, warmup=0)
MIN_EPOCHS = 2


@dataclass(frozen=True)
class Framework:
    """What differs between the frameworks' overhead benchmarks."""

    title: str
    handwritten: str
    """The hand-written loop's variant in ``interleaved.VARIANTS``."""
    hvdtrain: str
    """hvdtrain's variant in ``interleaved.VARIANTS``."""
    note: str
    """What the reader must know about this framework's two sides beyond the common notes."""


FRAMEWORKS = {
    "torch": Framework(
        "PyTorch", "handwritten_torch", "hvdtrain_torch",
        "Hand-written side: `hvd.DistributedOptimizer`, `DistributedSampler` order, batches cut by "
        "tensor indexing, one `torch.save` on rank 0."),
    "tensorflow": Framework(
        "TensorFlow", "handwritten_tf", "hvdtrain_tf",
        "Hand-written side: a `tf.function` step on `hvd.DistributedGradientTape` with a fixed "
        "input signature, an eager evaluation, one `np.savez` on rank 0. Both sides trace their "
        "step once, on the first step: the whole run holds that trace, the steady state does not. "
        "hvdtrain also traces its `tf.function` evaluation, in the whole run only."),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--quick`` changes the defaults of rounds, epochs and warm-up only."""
    parser = launch.make_parser(__doc__.splitlines()[0], FULL, QUICK)
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), default="torch",
                        help="whose trainer and hand-written loop to compare (default torch)")
    return launch.parse_args(parser, argv, FULL, QUICK, min_epochs=MIN_EPOCHS)


def variants(framework: str) -> list[Variant]:
    """The three interleaved variants: A, B and A'."""
    chosen = FRAMEWORKS[framework]
    return [Variant(BASELINE, chosen.handwritten), Variant(CANDIDATE, chosen.hvdtrain),
            Variant(CONTROL, chosen.handwritten)]


def verdict(rows: Sequence[Row]) -> str:
    """Whether the target is met, missed, or cannot be judged because the A/A control is too noisy."""
    return launch.ratio_verdict(rows, CANDIDATE, CONTROL, "hvdtrain / hand-written", TARGET_RATIO,
                                AA_TOLERANCE)


def notes(args: argparse.Namespace, results: Results, whole: Sequence[Row],
          steady: Sequence[Row]) -> list[str]:
    """The lines under the tables: workload, what is timed, that both sides learn alike, verdicts."""
    return [
        launch.workload_note(args, results[BASELINE][0]["steps"]),
        "Whole run: step time = the run's training wall time (first step through the final "
        "evaluation and checkpoint; process start, imports and `hvd.init` excluded) / optimizer "
        "steps, on rank 0.",
        launch.STEADY_NOTE,
        FRAMEWORKS[args.framework].note,
        launch.one_time_note(results),
        launch.accuracy_note(results),
        f"Result, whole run: {verdict(whole)}.",
        f"Result, steady state: {verdict(steady)}.",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints the section and, unless ``--no-write``, writes it to the doc."""
    args = parse_args(argv)
    title = (f"Trainer overhead: hvdtrain {FRAMEWORKS[args.framework].title} trainer vs a "
             "hand-written Horovod loop (step time)")
    return launch.step_time_benchmark(args, variants(args.framework), title, "overhead.py", notes)


if __name__ == "__main__":
    sys.exit(main())
