"""The cost of monitoring: hvdtrain's step time with every sink on against every sink off.

Off (A, and the A/A control A'): ``log.jsonl``, ``log.console``, ``log.tensorboard``,
``log.wandb`` and ``log.system`` all off; what remains is what training needs (the metrics
allreduce, which also carries the stop and NaN controls). On (B): every one of them on (an
offline W&B run, console lines). Only config switches differ (``workload.SINKS``); the
three run interleaved in one ``horovodrun -np 2`` job. Target: B/A at most 1.02 in the steady
state, judged where the A/A control is within 1% of 1.

Each rank is pinned to one core and runs beside an idle-class busy loop by default (``--bind
--spin``): the dashboards' writer process otherwise keeps the sinks-on ranks' cores awake, which
alone makes them faster on a virtual machine.

Usage (from the repository root)::

    .venv/bin/python benchmarks/monitoring.py --framework tensorflow
    .venv/bin/python benchmarks/monitoring.py --quick --no-write   # a tiny end-to-end check
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import harness
import workload

TARGET, TOLERANCE = 1.02, 0.01
OFF, ON, CONTROL = "sinks off (A)", "all sinks on (B)", "sinks off (A', A/A control)"
FRAMEWORKS = {"torch": ("PyTorch", "torch"), "tensorflow": ("TensorFlow", "tf")}
SIZES = {"rounds": (40, 1), "epochs": (20, 2), "warmup": (1, 0)}


def variants(framework: str) -> list[harness.Variant]:
    """A, B and A': keys of ``hvdtrain_worker.VARIANTS``."""
    short = FRAMEWORKS[framework][1]
    return [harness.Variant(OFF, f"hvdtrain_worker:sinks_off_{short}"),
            harness.Variant(ON, f"hvdtrain_worker:sinks_on_{short}"),
            harness.Variant(CONTROL, f"hvdtrain_worker:sinks_off_{short}")]


def verdict(rows: Sequence[harness.Row]) -> harness.Verdict:
    """On / off judged against the target beside the A/A control."""
    named = harness.by_name(rows)
    return harness.judge(named[ON].ratio, named[CONTROL].ratio, TARGET, TOLERANCE)


def switches(sinks: str) -> str:
    """The overrides of ``workload.SINKS[sinks]`` as Markdown code."""
    return ", ".join(f"`{switch}`" for switch in workload.SINKS[sinks])


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints its section and, unless ``--no-write``, writes it."""
    p = harness.parser("monitoring.py", __doc__.splitlines()[0], SIZES, interleaved=True,
                       timeout=3600.0)
    p.add_argument("--framework", choices=sorted(FRAMEWORKS), default="torch")
    p.set_defaults(bind=True, spin=True)
    args = harness.parse(p, argv)
    keys = ("step_time_s", "steady_step_time_s")
    machine, results, (whole, steady) = harness.measure(variants(args.framework), args, keys)
    notes = [*workload.notes(args, results),
             f"Sinks on: {switches('on')}, a record every {workload.LOG_EVERY} steps; off: "
             f"{switches('off')}. Both allreduce the same metrics.",
             f"Result, on / off, whole run: {verdict(whole)}.",
             f"Result, on / off, steady state: {verdict(steady)}."]
    name = FRAMEWORKS[args.framework][0]
    title = (f"Monitoring cost: hvdtrain {name} trainer with every sink on vs every sink off "
             "(step time)")
    blocks = [harness.table_block("Whole run (wall time / steps):", whole),
              harness.table_block(f"Steady state ({workload.STEADY_SPAN}):", steady)]
    entry = harness.Entry(
        label=f"Monitoring cost, {name}", script=f"monitoring.py --framework {args.framework}",
        target=f"every sink on / every sink off step time <= {TARGET} at steady state",
        verdict=f"steady state {harness.brief(verdict(steady), harness.by_name(steady)[ON])}; "
                f"whole run {harness.brief(verdict(whole), harness.by_name(whole)[ON])}")
    harness.publish(harness.section_text(title, args.command, machine, blocks, notes,
                                         entry=entry), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
