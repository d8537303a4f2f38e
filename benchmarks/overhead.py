"""Trainer overhead: hvdtrain's PyTorch or TensorFlow trainer against a hand-written Horovod loop.

Both sides train the same MLP on the same digits split with the same batch, optimizer and epochs,
interleaved in one ``horovodrun -np 2`` job: the hand-written loop (``handwritten_torch.py`` or
``handwritten_tf.py``) as the baseline A and the A/A control A', hvdtrain (``hvdtrain_worker.py``)
as B. Step time is reported over the whole run and over the steady state (``workload.Clock``),
which matters for TensorFlow, whose first step traces a ``tf.function``. Target: B/A at most 1.03
where the A/A control is within 1% of 1.

Usage (from the repository root)::

    .venv/bin/python benchmarks/overhead.py --framework tensorflow
    .venv/bin/python benchmarks/overhead.py --quick --no-write     # a tiny end-to-end check
    .venv/bin/python benchmarks/overhead.py --candidate api        # a user loop on the API as B

``--candidate api`` measures the hand-written loop on hvdtrain's library API instead of the
trainer (``api_worker.py``, docs/own-loop.md). On a loaded machine, where step time measures the
neighbours, ``overhead_cpu.py`` compares the same variants by CPU time a step instead.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import harness
import workload

TARGET, TOLERANCE = 1.03, 0.01
BASELINE, CANDIDATE, CONTROL = "handwritten (A)", "hvdtrain (B)", "handwritten (A', A/A control)"
FRAMEWORKS = {
    "torch": ("PyTorch", "handwritten_torch:handwritten_torch", "hvdtrain_worker:hvdtrain_torch"),
    "tensorflow": ("TensorFlow", "handwritten_tf:handwritten_tf", "hvdtrain_worker:hvdtrain_tf"),
}
# ``--candidate api``: B is the hand-written loop on the library API (docs/own-loop.md).
API = {"torch": "api_worker:api_torch", "tensorflow": "api_worker:api_tf"}
# Many short runs: the median of many settles better than that of a few long ones.
SIZES = {"rounds": (60, 1), "epochs": (4, 2), "warmup": (1, 0)}


def variants(framework: str, candidate: str = "trainer") -> list[harness.Variant]:
    """A, B and A'."""
    _, handwritten, hvdtrain = FRAMEWORKS[framework]
    hvdtrain = API[framework] if candidate == "api" else hvdtrain
    return [harness.Variant(BASELINE, handwritten), harness.Variant(CANDIDATE, hvdtrain),
            harness.Variant(CONTROL, handwritten)]


def verdicts(*tables: Sequence[harness.Row]) -> list[harness.Verdict]:
    """B/A of each table judged against the target beside its A/A control."""
    return [harness.judge(harness.by_name(rows)[CANDIDATE].ratio,
                          harness.by_name(rows)[CONTROL].ratio, TARGET, TOLERANCE)
            for rows in tables]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints its section and, unless ``--no-write``, writes it."""
    p = harness.parser("overhead.py", __doc__.splitlines()[0], SIZES, interleaved=True)
    p.add_argument("--framework", choices=sorted(FRAMEWORKS), default="torch")
    p.add_argument("--candidate", choices=("trainer", "api"), default="trainer",
                   help="B: the config-driven trainer, or the hand-written loop on the API")
    args = harness.parse(p, argv)
    keys = ("step_time_s", "steady_step_time_s")
    if args.candidate == "api" and args.framework not in API:
        p.error(f"--candidate api: no API loop for {args.framework} yet")
    machine, results, (whole, steady) = harness.measure(
        variants(args.framework, args.candidate), args, keys)
    whole_verdict, steady_verdict = verdicts(whole, steady)
    notes = [*workload.notes(args, results),
             f"Result, hvdtrain / hand-written, whole run: {whole_verdict}.",
             f"Result, hvdtrain / hand-written, steady state: {steady_verdict}."]
    name = FRAMEWORKS[args.framework][0]
    what = "API loop" if args.candidate == "api" else "trainer"
    title = f"Trainer overhead: hvdtrain {name} {what} vs a hand-written Horovod loop (step time)"
    blocks = [harness.table_block("Whole run (wall time / steps):", whole),
              harness.table_block(f"Steady state ({workload.STEADY_SPAN}):", steady)]
    entry = harness.Entry(
        label=f"Trainer overhead, {name}" + (" API loop" if args.candidate == "api" else ""),
        script=f"overhead.py --framework {args.framework}" + (
            " --candidate api" if args.candidate == "api" else ""),
        target=f"hvdtrain / hand-written step time <= {TARGET}",
        verdict=f"steady state {harness.brief(steady_verdict, harness.by_name(steady)[CANDIDATE])}"
                f"; whole run {harness.brief(whole_verdict, harness.by_name(whole)[CANDIDATE])}")
    harness.publish(harness.section_text(title, args.command, machine, blocks, notes,
                                         entry=entry), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
