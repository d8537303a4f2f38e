"""One benchmark job: the compared variants run interleaved, in rounds, in the same processes.

Run under ``horovodrun -np 2 --gloo python scripts/bench/interleaved.py --variants
handwritten_torch,hvdtrain_torch,handwritten_torch --rounds 20 --epochs 4``. Every rank runs the
same sequence: ``--warmup`` discarded rounds, then ``--rounds`` measured ones, each running every
variant once, in the order of ``--variants`` on even rounds and reversed on odd ones
(``harness.round_order``). A variant may be listed twice (the A/A control); each listed slot is
measured separately. Rank 0 prints one JSON line per run: the worker's measurement plus ``round``
(negative in warm-up), ``slot`` (the index in ``--variants``) and ``variant``.

In one job every variant shares the processes, the pairing of the ranks and the OS's placement of
them, which separate jobs do not: on a small machine two identical jobs differ by tens of percent.
A variant's module is imported only when listed, so a PyTorch job never loads TensorFlow.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import harness
import workload

Run = Callable[[int, Path], dict[str, Any]]
"""A variant: ``run(epochs, out_dir)`` trains once from scratch; returns this rank's measurement."""

VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "handwritten_torch": ("handwritten_torch", {}),
    "handwritten_tf": ("handwritten_tf", {}),
    "hvdtrain_torch": ("hvdtrain_worker", {"framework": "torch"}),
    "hvdtrain_tf": ("hvdtrain_worker", {"framework": "tensorflow"}),
    # monitoring.py: every sink off, every sink on, on but muted in every other block, and off
    # in the same blocks (hvdtrain_worker.SINKS and Alternation).
    "sinks_off_torch": ("hvdtrain_worker", {"framework": "torch", "sinks": "off"}),
    "sinks_on_torch": ("hvdtrain_worker", {"framework": "torch", "sinks": "on"}),
    "sinks_alternate_torch": ("hvdtrain_worker", {"framework": "torch", "sinks": "alternate"}),
    "sinks_alternate_off_torch": ("hvdtrain_worker", {"framework": "torch",
                                                      "sinks": "alternate_off"}),
    "sinks_off_tf": ("hvdtrain_worker", {"framework": "tensorflow", "sinks": "off"}),
    "sinks_on_tf": ("hvdtrain_worker", {"framework": "tensorflow", "sinks": "on"}),
    "sinks_alternate_tf": ("hvdtrain_worker", {"framework": "tensorflow", "sinks": "alternate"}),
    "sinks_alternate_off_tf": ("hvdtrain_worker", {"framework": "tensorflow",
                                                   "sinks": "alternate_off"}),
}
"""Each variant's worker module in this directory and the options its ``run`` gets first."""


def load_variant(name: str) -> Run:
    """The variant's ``run(epochs, out_dir)``, importing its worker module on first use."""
    module_name, options = VARIANTS[name]
    run = importlib.import_module(module_name).run
    return lambda epochs, out_dir: run(**options, epochs=epochs, out_dir=out_dir)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options: the variants, rounds, warm-up rounds, epochs and output directory."""
    parser = workload.worker_parser(__doc__.splitlines()[0])
    parser.add_argument("--variants", required=True,
                        help=f"comma-separated, from: {', '.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=10, help="measured rounds (default 10)")
    parser.add_argument("--warmup", type=int, default=1, help="discarded rounds first (default 1)")
    parser.add_argument("--bind", action="store_true",
                        help="pin each rank to core (local rank mod cores), like `srun "
                             "--cpu-bind=cores`: the OS then cannot move two ranks onto one core")
    parser.add_argument("--spin", action="store_true",
                        help="run an idle-class busy loop beside each rank (workload.IdleSpinner)")
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    unknown = [name for name in args.variants if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants: {', '.join(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs every round and prints each run's measurement on rank 0."""
    args = parse_args(argv)
    if args.bind:
        workload.bind_to_core()
    with workload.IdleSpinner(args.spin):
        return run_rounds(args)


def run_rounds(args: argparse.Namespace) -> int:
    """Every round of every variant; rank 0 prints each run's measurement."""
    runs = {name: load_variant(name) for name in args.variants}
    base = workload.out_dir(args.out_dir, "hvdtrain-bench-")
    slots = list(enumerate(args.variants))
    for round_index in range(-args.warmup, args.rounds):
        for slot, name in harness.round_order(slots, round_index):
            # Garbage left by the previous run is collected here, not inside the next one's timing.
            gc.collect()
            record = runs[name](args.epochs, base / f"slot{slot}")
            workload.report({"round": round_index, "slot": slot, "variant": name, **record})
    return 0


if __name__ == "__main__":
    sys.exit(main())
