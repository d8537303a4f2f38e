"""Frameworks: samples/s of hvdtrain's PyTorch trainer against its TensorFlow trainer, same config.

Both run ``hvdtrain_worker.run`` with the same overrides, interleaved in one ``horovodrun -np 2``
job (every process loads both frameworks' Horovod): PyTorch as the baseline A and the A/A control
A', TensorFlow as B. Samples per second over the whole run (which holds TensorFlow's one-time
``tf.function`` traces) and over the steady state (``workload.Clock``). No target: a ratio above 1
means TensorFlow was faster.

Usage (from the repository root)::

    .venv/bin/python benchmarks/frameworks.py
    .venv/bin/python benchmarks/frameworks.py --quick --no-write   # a tiny end-to-end check
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import harness
import workload

BASELINE, CANDIDATE, CONTROL = "torch (A)", "tensorflow (B)", "torch (A', A/A control)"
SIZES = {"rounds": (60, 1), "epochs": (4, 2), "warmup": (1, 0)}
VARIANTS = [harness.Variant(BASELINE, "hvdtrain_worker:hvdtrain_torch"),
            harness.Variant(CANDIDATE, "hvdtrain_worker:hvdtrain_tf"),
            harness.Variant(CONTROL, "hvdtrain_worker:hvdtrain_torch")]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints its section and, unless ``--no-write``, writes it."""
    args = harness.parse(harness.parser("frameworks.py", __doc__.splitlines()[0], SIZES,
                                        interleaved=True), argv)
    keys = ("samples_per_s", "steady_samples_per_s")
    machine, results, (whole, steady) = harness.measure(VARIANTS, args, keys)
    ratios = "; ".join(f"{label}: tensorflow / torch = {harness.by_name(rows)[CANDIDATE].ratio:.3f}"
                       f", A/A control = {harness.by_name(rows)[CONTROL].ratio:.3f}"
                       for label, rows in (("whole run", whole), ("steady state", steady)))
    notes = [*workload.notes(args, results), f"Result: {ratios}."]
    fmt = {"unit": "samples/s", "scale": 1.0, "digits": 0}
    blocks = [harness.table_block("Whole run (samples / wall time):", whole, **fmt),
              harness.table_block(f"Steady state ({workload.STEADY_SPAN}):", steady, **fmt)]
    entry = harness.Entry(label="Frameworks", script="frameworks.py", target="none (a comparison)",
                          verdict="no target; TensorFlow / PyTorch time per sample: " + ", ".join(
                              f"{1 / harness.by_name(rows)[CANDIDATE].ratio:.3f} {label} (A/A "
                              f"{1 / harness.by_name(rows)[CONTROL].ratio:.3f})"
                              for label, rows in (("whole run", whole), ("steady state", steady))))
    harness.publish(harness.section_text(
        "Frameworks: hvdtrain PyTorch trainer vs hvdtrain TensorFlow trainer (samples/s)",
        args.command, machine, blocks, notes, entry=entry), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
