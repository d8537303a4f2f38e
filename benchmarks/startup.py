"""Start-up: ``hvdtrain train`` against a hand-written Horovod script, as whole processes.

Each run is a fresh ``horovodrun -np 2`` launch that trains one epoch of the digits MLP: the
hand-written loop (``workload.py --variants handwritten_torch:handwritten_torch``, or the TensorFlow
one) as the baseline A and the A/A control A', and ``hvdtrain train configs/digits_*.yaml`` with
``hvdtrain_worker.overrides`` (the same settings) as B. Figure: rank 0's start-up, from its
process's start to the end of its first training step (interpreter, imports, ``hvd.init``, the
data, the model, the broadcasts, the first step's trace): hvdtrain's ``summary.json["startup_s"]``
and the hand-written loops' ``workload.Clock``, both read against ``/proc/self/stat``. The
launcher's own start is outside both. Target: B/A at most 1.1.

Usage (from the repository root)::

    .venv/bin/python benchmarks/startup.py --framework torch
    .venv/bin/python benchmarks/startup.py --quick --no-write     # a tiny end-to-end check
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import harness
import workload

KEY = "startup_s"
TARGET = 1.1
BASELINE, CANDIDATE = "handwritten (A)", "hvdtrain train (B)"
CONTROL = "handwritten (A', A/A control)"
FRAMEWORKS = {"torch": ("PyTorch", "handwritten_torch:handwritten_torch"),
              "tensorflow": ("TensorFlow", "handwritten_tf:handwritten_tf")}
SIZES = {"rounds": (8, 1), "warmup": (1, 0)}
HERE = Path(__file__).resolve().parent


def launcher(args: argparse.Namespace) -> list[str]:
    """``horovodrun -np N --CONTROLLER``."""
    return [harness.horovodrun(), "-np", str(args.np), f"--{args.controller}"]


def jobs(args: argparse.Namespace, work: Path) -> list[harness.Job]:
    """A, B and A': each a whole launch; B through :func:`hvdtrain_job`, which prints its figure."""
    python = str(harness.python())
    handwritten = [*launcher(args), python, str(HERE / "workload.py"), "--variants",
                   FRAMEWORKS[args.framework][1], "--epochs", "1", "--out-dir", str(work / "a")]
    hvdtrain = [python, str(Path(__file__).resolve()), "--hvdtrain-job", args.framework,
                "--np", str(args.np), "--controller", args.controller, "--job-dir", str(work / "b")]
    return [harness.Job(BASELINE, handwritten, {}), harness.Job(CANDIDATE, hvdtrain, {}),
            harness.Job(CONTROL, handwritten, {})]


def hvdtrain_job(args: argparse.Namespace) -> int:
    """One launch of ``hvdtrain train``; prints the summary's start-up as a measurement record."""
    import hvdtrain_worker  # imports hvdtrain: only here, in the process that measures nothing
    from hvdtrain.rundir import RunDir

    cfg = hvdtrain_worker.CONFIGS[args.hvdtrain_job]
    command = [*launcher(args), str(harness.python().with_name("hvdtrain")), "train", str(cfg),
               *hvdtrain_worker.overrides(args.hvdtrain_job, 1, args.job_dir)]
    subprocess.run(command, check=True, stdout=sys.stderr)
    summary = json.loads(RunDir(args.job_dir).summary.read_text())
    print(json.dumps({"rank": 0, KEY: summary[KEY][0]}), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the launches in rounds, prints the section and, unless ``--no-write``, writes it."""
    p = harness.parser("startup.py", __doc__.splitlines()[0], SIZES, timeout=600.0)
    p.add_argument("--framework", choices=sorted(FRAMEWORKS), default="torch")
    p.add_argument("--np", type=int, default=2, help="ranks of each launch (default 2)")
    p.add_argument("--controller", choices=("gloo", "mpi"), default="gloo")
    p.add_argument("--hvdtrain-job", choices=sorted(FRAMEWORKS), help=argparse.SUPPRESS)
    p.add_argument("--job-dir", type=Path, help=argparse.SUPPRESS)
    args = harness.parse(p, argv)
    if args.hvdtrain_job:
        return hvdtrain_job(args)
    machine = harness.machine_record()
    with tempfile.TemporaryDirectory(prefix="hvdtrain-startup-") as work:
        results = harness.run_jobs(jobs(args, Path(work)), args.rounds, args.warmup, KEY,
                                   args.timeout)
    rows = harness.summarize(harness.samples_of(results, KEY), BASELINE)
    named = harness.by_name(rows)
    verdict = harness.judge(named[CANDIDATE].ratio, named[CONTROL].ratio, TARGET,
                            higher_is_better=False)
    name = FRAMEWORKS[args.framework][0]
    notes = [
        f"Workload: one epoch of the digits MLP ({workload.BATCH_SIZE} a rank a step), "
        f"`horovodrun -np {args.np} --{args.controller}`, each run a whole launch; "
        f"{args.rounds} rounds after {args.warmup} warm-up, in alternating order.",
        "Figure: rank 0's seconds from its process's start to the end of its first "
        "training step (hvdtrain: `summary.json`'s `startup_s`; hand-written: the same reading "
        "in `workload.Clock`). The launcher's start is outside both.",
        "Both sides load the bytecode that `make setup` compiles; without it every process "
        "compiles the sources it imports "
        "([step-overhead.md](investigations/step-overhead.md#start-up)).",
        f"Result, hvdtrain / hand-written: {verdict}.",
    ]
    entry = harness.Entry(
        label=f"Start-up, {name}", script=f"startup.py --framework {args.framework}",
        target=f"hvdtrain / hand-written seconds to the end of the first step <= {TARGET}",
        verdict=f"{harness.brief(verdict, named[CANDIDATE])}; hvdtrain "
                f"{named[CANDIDATE].median:.1f} s, hand-written {named[BASELINE].median:.1f} s")
    harness.publish(harness.section_text(
        f"Start-up, {name}: `hvdtrain train` vs a hand-written Horovod script (seconds to the end "
        "of the first step)", args.command, machine,
        [harness.table_block("", rows, unit="s", scale=1.0, digits=2)], notes, entry=entry), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
