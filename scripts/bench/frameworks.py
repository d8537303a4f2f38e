"""Frameworks: samples/s of hvdtrain's PyTorch trainer against its TensorFlow trainer, same config.

Both variants run ``hvdtrain_worker.run`` with the same overrides (digits MLP, batch 32 per rank,
SGD, one evaluation and one checkpoint at the end), the one with ``framework="torch"``, the other
with ``"tensorflow"``, all runs in one ``horovodrun -np 2`` job (``interleaved.py``), so every
process loads both frameworks' Horovod libraries. The PyTorch trainer runs twice per round, as the
baseline A and as the A/A control A', interleaved with the TensorFlow trainer (B). Two measures of
the same runs are reported: samples over the whole training wall time, which holds TensorFlow's
one-time ``tf.function`` traces, and samples over the steady state (epochs 2 to N, up to the final
evaluation; see ``workload.Clock``). A ratio above 1 means TensorFlow was faster.

Usage (from the repository root)::

    .venv/bin/python scripts/bench/frameworks.py                    # writes its section of docs/benchmarks.md
    .venv/bin/python scripts/bench/frameworks.py --quick --no-write   # a tiny end-to-end check
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import harness
import launch
from harness import Row
from launch import Results, Sizes, Variant

KEY = "samples_per_s"
STEADY_KEY = "steady_samples_per_s"

BASELINE, CANDIDATE, CONTROL = "torch (A)", "tensorflow (B)", "torch (A', A/A control)"

# Many short runs: the median of many settles better than that of a few long ones, and the whole
# benchmark stays within about 6 minutes on a 2-core machine.
FULL = Sizes(rounds=60, epochs=4, warmup=1)
# Two epochs: the steady state leaves the first one out and needs one more.
QUICK = Sizes(rounds=1, epochs=2, warmup=0)
MIN_EPOCHS = 2


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--quick`` changes the defaults of rounds, epochs and warm-up only."""
    parser = launch.make_parser(__doc__.splitlines()[0], FULL, QUICK)
    return launch.parse_args(parser, argv, FULL, QUICK, min_epochs=MIN_EPOCHS)


def variants() -> list[Variant]:
    """The three interleaved variants: A (torch), B (TensorFlow) and A' (torch again)."""
    return [Variant(BASELINE, "hvdtrain_torch"), Variant(CANDIDATE, "hvdtrain_tf"),
            Variant(CONTROL, "hvdtrain_torch")]


def summary_line(label: str, rows: Sequence[Row]) -> str:
    """``label: TF / torch = r, A/A control = c`` for one measure."""
    by_name = {row.name: row for row in rows}
    return (f"{label}: tensorflow / torch = {by_name[CANDIDATE].ratio:.3f}, "
            f"A/A control = {by_name[CONTROL].ratio:.3f}")


def notes(args: argparse.Namespace, results: Results, whole: Sequence[Row],
          steady: Sequence[Row]) -> list[str]:
    """The lines under the tables: workload, what each measure holds, accuracy, the ratios."""
    return [
        launch.workload_note(args, results[BASELINE][0]["steps"]),
        "Whole run = hvdtrain's summary (`summary.json`) `samples` / `wall_time_s` on rank 0: the "
        "loop from the first step through the final evaluation and checkpoint (process start, "
        "imports, `hvd.init`, model build and the initial broadcast excluded). For TensorFlow it "
        "includes the one-time `tf.function` traces of the train step (first step) and of the "
        "evaluation (at the end).",
        launch.STEADY_NOTE,
        "Every process of the job has loaded and initialised both `horovod.torch` and "
        "`horovod.tensorflow` (each with its own background thread), during the runs of both "
        "frameworks alike; separate single-framework jobs would each carry one.",
        launch.one_time_note(results),
        "Ratio: a variant's median samples/s over the PyTorch trainer's (A); above 1, TensorFlow "
        "processed more samples per second. A' is the PyTorch trainer again (A/A control): a ratio "
        "no farther from 1 than the control's is noise.",
        launch.accuracy_note(results),
        f"Result: {summary_line('whole run', whole)}; {summary_line('steady state', steady)}.",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints the section and, unless ``--no-write``, writes it to the doc."""
    args = parse_args(argv)
    machine, results = launch.run(variants(), args, KEY)
    whole = harness.summarize(harness.samples_of(results, KEY), baseline=BASELINE)
    steady = harness.summarize(harness.samples_of(results, STEADY_KEY), baseline=BASELINE)
    section = harness.markdown_section(
        "Frameworks: hvdtrain PyTorch trainer vs hvdtrain TensorFlow trainer (samples/s)",
        launch.reproduce_command("frameworks.py", args), machine, whole,
        notes(args, results, whole, steady), unit="samples/s", scale=1.0, digits=0,
        caption="Whole run (samples / training wall time):",
        tables=[(f"Steady state ({launch.STEADY_SPAN}; samples / seconds):", steady)])
    launch.publish(section, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
