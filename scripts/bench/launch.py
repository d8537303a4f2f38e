"""What the benchmark drivers share: their common options, the Horovod job they start, the doc.

``overhead.py`` and ``frameworks.py`` each compare variants through :mod:`harness`; this module
parses the options they share, finds ``horovodrun``, starts the one job (``interleaved.py``) that
runs all the variants interleaved, collects its per-run measurements and writes the resulting
section to ``docs/benchmarks.md``. Like the harness, it imports no framework.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import harness
import workload

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

HEADER = """# Benchmarks

Every table here comes from a script in `scripts/bench/`; each section gives the date, the command
that reproduces it (run from the repository root after `make setup`) and the machine.

Method (`scripts/bench/harness.py`, `scripts/bench/interleaved.py`): all compared variants run
inside ONE `horovodrun` job, interleaved in rounds, one run of each per round, in alternating order
(A B A' in one round, A' B A in the next), after a discarded warm-up round. So they share the same
processes, the same pairing of ranks and the same placement by the OS, and a busy spell of the
machine hits all of them alike; separate jobs of the same command differed by up to 3x on this
2-core machine, depending on how each job's processes happened to be scheduled. Every run builds
its model, optimizer and data order from scratch and measures itself; rank 0 prints each result as
JSON. The tables give min, median and max over the rounds and each median's ratio to the
baseline's median. A' is a second copy of the baseline A: its ratio, the A/A control, shows how much
two identical variants disagree, and a difference smaller than that is noise, not a finding.
Timings are never asserted in tests.
"""

Results = dict[str, list[dict[str, Any]]]
"""Each compared variant's measurements, one per measured round (``harness.group_runs``)."""


@dataclass(frozen=True)
class Sizes:
    """How much a benchmark runs: measured rounds, epochs per run, discarded warm-up rounds."""

    rounds: int
    epochs: int
    warmup: int


@dataclass(frozen=True)
class Variant:
    """One compared variant: its table name and its key in ``interleaved.VARIANTS``."""

    name: str
    key: str


def make_parser(description: str, full: Sizes, quick: Sizes) -> argparse.ArgumentParser:
    """A parser of the options every driver takes; a driver may add its own before parsing."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, help=f"measured rounds (default {full.rounds})")
    parser.add_argument("--epochs", type=int, help=f"epochs per run (default {full.epochs})")
    parser.add_argument("--warmup", type=int, help=f"discarded rounds first (default {full.warmup})")
    parser.add_argument("--np", type=int, default=2, help="ranks of the job (default 2)")
    parser.add_argument("--controller", choices=("gloo", "mpi"), default="gloo")
    parser.add_argument("--bind", action=argparse.BooleanOptionalAction, default=False,
                        help="pin each rank to one core, as `srun --cpu-bind=cores` would "
                             "(interleaved.py --bind)")
    parser.add_argument("--spin", action=argparse.BooleanOptionalAction, default=False,
                        help="keep every rank's core out of its idle state with an idle-class "
                             "busy loop (interleaved.py --spin)")
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny check: defaults {vars(quick)} instead of {vars(full)}")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--timeout", type=float, default=1200.0,
                        help="seconds allowed for the whole job (default %(default)g)")
    parser.add_argument("--records", type=Path,
                        help="also write every run's measurement here, one JSON line each")
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


def job_command(variants: Sequence[Variant], args: argparse.Namespace, work: Path) -> list[str]:
    """The command line of the one ``horovodrun`` job that runs all ``variants`` interleaved."""
    return [horovodrun(), "-np", str(args.np), f"--{args.controller}", str(python()),
            str(HERE / "interleaved.py"), "--variants", ",".join(v.key for v in variants),
            "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--epochs",
            str(args.epochs), "--out-dir", str(work), *job_options(args)]


def job_options(args: argparse.Namespace) -> list[str]:
    """``--bind`` and ``--spin`` as given, for the job and for the command that reproduces it."""
    return [flag for flag in ("--bind", "--spin") if getattr(args, flag[2:])]


def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the jobs: Open MPI refuses to start as root without these two.

    ``extra`` variables (such as ``HOROVOD_FUSION_THRESHOLD``) are added last and win.
    """
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.update(extra or {})
    return env


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _describe(record: dict[str, Any], key: str) -> str:
    """One log line for a record; records of one-run jobs may lack the round and slot."""
    where = ""
    if "round" in record:
        where = "warm-up " if record["round"] < 0 else f"round {record['round'] + 1} "
    size = f" {record['size']} B" if "size" in record else ""
    return f"{where}{record.get('variant', '')}{size}: {key}={record[key]:.6g}"


def run_job(argv: Sequence[str], key: str, timeout: float,
            env: Mapping[str, str] | None = None,
            on_record: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Runs the job, logging each run as it comes, and returns every per-run record it printed.

    ``env`` holds variables added to the job's environment (see :func:`worker_env`);
    ``on_record`` is called with each record as it arrives. Raises
    :class:`harness.BenchError` with the output's tail when the job fails or times out.
    """
    tail: deque[str] = deque(maxlen=30)
    records: list[dict[str, Any]] = []
    started = time.monotonic()
    # One pipe for both streams: reading two pipes one after the other could deadlock. A session of
    # its own lets a timeout kill the workers too, not only horovodrun.
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=worker_env(env), start_new_session=True) as proc:
        timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                tail.append(line.rstrip("\n"))
                for record in harness.parse_measurements(line, key):
                    records.append(record)
                    _log(_describe(record, key))
                    if on_record:
                        on_record(record)
        finally:
            timer.cancel()
    if proc.returncode != 0:
        reason = (f"no result within {timeout:g} s" if time.monotonic() - started >= timeout
                  else f"exit code {proc.returncode}")
        raise harness.BenchError(f"benchmark job: {reason}\n" + "\n".join(tail))
    return records


def run(variants: Sequence[Variant], args: argparse.Namespace,
        key: str) -> tuple[dict[str, Any], Results]:
    """Runs the variants interleaved in one job; returns the machine record and their measurements."""
    # Taken before the job, so that the load average shows what else the machine was doing.
    machine = harness.machine_record()
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as work:
        # Written as they come, so that a job cut short by its timeout still leaves its runs.
        with args.records.open("w") if args.records else contextlib.nullcontext() as out:
            def keep(record: dict[str, Any]) -> None:
                print(json.dumps(record), file=out, flush=True)

            records = run_job(job_command(variants, args, Path(work)), key, args.timeout,
                              on_record=keep if out else None)
    return machine, harness.group_runs(records, [v.name for v in variants], args.rounds)


def reproduce_interpreter() -> Path:
    """This interpreter as a reader should type it: relative to the repository root when inside."""
    interpreter = python()
    return interpreter.relative_to(ROOT) if interpreter.is_relative_to(ROOT) else interpreter


def reproduce_command(script: str, args: argparse.Namespace, extra: Sequence[str] = ()) -> str:
    """The command line that repeats a driver's benchmark, with every setting spelled out."""
    argv = [str(reproduce_interpreter()), f"scripts/bench/{script}", *extra, "--rounds", str(args.rounds),
            "--epochs", str(args.epochs), "--warmup", str(args.warmup), "--np", str(args.np),
            "--controller", args.controller, *job_options(args)]
    return shlex.join(argv)


STEADY_SPAN = "epochs 2 to N, up to the final evaluation"
STEADY_NOTE = (
    "Steady state: from the start of the first step of epoch 2 to the start of the final "
    "evaluation, on rank 0, per step (or samples per second) in that span: every step of epochs "
    "2 to N and the work between steps (metric logging and allreduce, shuffling), but no "
    "`tf.function` trace, first-epoch warm-up, evaluation or checkpoint. Every worker notes these "
    "two times the same way (`workload.Clock`; hvdtrain's through a wrapper around its engine's "
    "`train_step` and `evaluate`).")
"""The note that defines the steady state, which every driver reports next to the whole run."""


def one_time_cost(measurement: dict[str, Any]) -> float:
    """Seconds of a run's wall time that its steady state leaves out (see :func:`one_time_note`)."""
    m = measurement
    return m["wall_time_s"] - m["steady_step_time_s"] * m["steps"]


def one_time_note(results: Results) -> str:
    """The note with each variant's median one-time cost: the whole-run time the steady state leaves out.

    It is the wall time less the steady step time times the steps: the first epoch's excess over
    a steady epoch (a ``tf.function`` trace, warm-up), the final evaluation and the checkpoint.
    Noise can make it slightly negative where there is no such cost.
    """
    costs = ", ".join(f"{name} {statistics.median(one_time_cost(m) for m in runs):.3f} s"
                      for name, runs in results.items())
    return ("Median one-time cost per run (wall time - steady step time x steps: the first "
            "epoch's excess, such as a `tf.function` trace, plus the final evaluation and "
            f"checkpoint): {costs}.")


def workload_note(args: argparse.Namespace, steps: int) -> str:
    """The note that says what every run trained, in what job, and how many runs the table holds."""
    return (f"Workload: digits MLP (64-{workload.HIDDEN}-10), all runs in one `horovodrun -np "
            f"{args.np} --{args.controller}` job, batch {workload.BATCH_SIZE} per rank, SGD lr "
            f"{workload.BASE_LR} x {args.np} momentum {workload.MOMENTUM}; per run {args.epochs} "
            f"epoch(s), {steps} steps; rounds: {args.rounds} measured after {args.warmup} warm-up.")


def accuracy_note(results: Results) -> str:
    """The note that shows every variant learned the same problem: its median final test accuracy."""
    accuracy = ", ".join(f"{name} {statistics.median(m['eval_accuracy'] for m in runs):.3f}"
                         for name, runs in results.items())
    return f"Median final test accuracy (all variants train the same problem): {accuracy}."


def publish(section: str, args: argparse.Namespace) -> None:
    """Prints ``section`` and, unless ``--no-write``, writes it into the output document (replacing the section of the same title)."""
    print(section)
    if not args.no_write:
        harness.put_section(args.output, section, HEADER)
        print(f"[bench] written to {args.output}", file=sys.stderr)


@dataclass(frozen=True)
class Job:
    """A compared variant that is a job of its own: its table name, command line and environment.

    Used where the variants cannot share processes: different launchers (``torchrun`` against
    ``horovodrun``), process counts, or Horovod settings read once at ``hvd.init``.
    """

    name: str
    argv: list[str]
    env: dict[str, str]


def run_jobs(jobs: Sequence[Job], rounds: int, warmup: int, key: str,
             timeout: float) -> Results:
    """Runs every job once per round, in :func:`harness.round_order`, after ``warmup`` discarded
    rounds; each job must print exactly one measurement holding ``key``."""
    records = []
    for round_index in range(-warmup, rounds):
        for slot, job in harness.round_order(list(enumerate(jobs)), round_index):
            found = run_job(job.argv, key, timeout, job.env)
            if len(found) != 1:
                raise harness.BenchError(f"{job.name}: expected one measurement, got {len(found)}")
            record = {**found[0], "round": round_index, "slot": slot, "variant": job.name}
            _log(_describe(record, key))
            records.append(record)
    return harness.group_runs(records, [job.name for job in jobs], rounds)


def resnet_argv(launcher: Sequence[str], args: argparse.Namespace, trainer: str,
                threads: int = 0) -> list[str]:
    """``launcher`` followed by one ``resnet_worker.py`` run with the ResNet options of ``args``
    (``steps``, ``skip``, ``batch``, ``width``)."""
    return [*launcher, str(HERE / "resnet_worker.py"), "--trainer", trainer, "--steps",
            str(args.steps), "--skip", str(args.skip), "--batch", str(args.batch), "--width",
            str(args.width), "--threads", str(threads)]


def resnet_parser(description: str, rounds: int, steps: int) -> argparse.ArgumentParser:
    """The options of the drivers that time ``resnet_worker.py`` jobs (``ddp.py``, ``scaling.py``);
    ``--quick`` makes one round of 4 steps of a width-8 network."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, help=f"measured rounds (default {rounds})")
    parser.add_argument("--warmup", type=int, help="discarded rounds first (default 0)")
    parser.add_argument("--steps", type=int, help=f"optimizer steps per job (default {steps})")
    parser.add_argument("--skip", type=int, default=3, help="first steps not timed (default 3)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank (default 32)")
    parser.add_argument("--width", type=int, help="resnet18 width (default 64: ResNet-18)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment variable for the horovodrun jobs, e.g. "
                             "HOROVOD_CYCLE_TIME=5 (repeatable)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny check: 1 round, 6 steps, width 8")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    parser.set_defaults(full=dict(rounds=rounds, warmup=0, steps=steps, width=64),
                        quick_sizes=dict(rounds=1, warmup=0, steps=6, width=8))
    return parser


def resnet_args(parser: argparse.ArgumentParser,
                argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses a :func:`resnet_parser`'s options; unset sizes come from ``--quick`` or the full."""
    args = parser.parse_args(argv)
    for name, default in (args.quick_sizes if args.quick else args.full).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.rounds < 1 or args.steps < args.skip + 2:
        parser.error("--rounds must be positive and --steps at least --skip + 2")
    if any("=" not in item for item in args.env):
        parser.error("--env takes NAME=VALUE")
    args.horovod_env = dict(item.split("=", 1) for item in args.env)
    return args


def resnet_command(script: str, args: argparse.Namespace) -> str:
    """The command line that repeats a ``resnet_worker.py`` driver's benchmark."""
    return shlex.join([str(reproduce_interpreter()), f"scripts/bench/{script}", "--rounds",
                       str(args.rounds), "--warmup", str(args.warmup), "--steps", str(args.steps),
                       "--skip", str(args.skip), "--batch", str(args.batch), "--width",
                       str(args.width), *[arg for item in args.env for arg in ("--env", item)]])


def resnet_note(args: argparse.Namespace) -> str:
    """What every ``resnet_worker.py`` job trained and how its throughput is taken."""
    params = ", 11.2 M parameters" if args.width == 64 else ""
    return (f"Workload: hvdtrain's `resnet18` (width {args.width}{params}) on "
            f"`synthetic_images` 3x32x32, 10 classes; batch {args.batch} per rank; SGD lr "
            f"{workload.BASE_LR} x ranks, momentum {workload.MOMENTUM}; {args.steps} steps per "
            f"job, samples/s over steps {args.skip + 1} to {args.steps - 1} (from the start of "
            f"the first timed step to the start of the last) on rank 0; {args.rounds} rounds "
            f"after {args.warmup} warm-up, one job per variant per round, order alternating; "
            f"environment of the horovodrun jobs: {' '.join(args.env) or 'Horovod defaults'}.")


def ratio_verdict(rows: Sequence[harness.Row], candidate: str, control: str, label: str,
                  target: float, tolerance: float) -> str:
    """``label = r, A/A control = c`` and whether ``r <= target`` is met, missed, or cannot be
    judged because the A/A control is farther than ``tolerance`` from 1."""
    by_name = {row.name: row for row in rows}
    return verdict_of(by_name[candidate].ratio, by_name[control].ratio, label, target, tolerance)


def verdict_of(ratio: float, aa: float, label: str, target: float, tolerance: float) -> str:
    """:func:`ratio_verdict` for a ratio and an A/A control given as numbers."""
    head = f"{label} = {ratio:.3f}, A/A control = {aa:.3f}"
    if abs(aa - 1.0) > tolerance:
        return (f"{head}: inconclusive, the A/A control is off by more than {tolerance:.0%}, so "
                f"the machine was too noisy to judge a {target} target")
    met = "met" if ratio <= target else "missed"
    return f"{head}: target (ratio <= {target} with A/A within {tolerance:.0%}) {met}"


def step_time_benchmark(args: argparse.Namespace, variants: Sequence[Variant], title: str,
                        script: str, notes: Callable[..., list[str]],
                        extra: Sequence[str] | None = None) -> int:
    """Runs interleaved step-time variants (the first is the baseline), then publishes a section
    with the whole-run and steady-state tables; ``notes(args, results, whole, steady)`` gives
    the lines under them, ``extra`` the script's own options in the command that reproduces it
    (default: ``--framework``)."""
    key, steady_key = "step_time_s", "steady_step_time_s"
    machine, results = run(variants, args, key)
    whole = harness.summarize(harness.samples_of(results, key), baseline=variants[0].name)
    steady = harness.summarize(harness.samples_of(results, steady_key), baseline=variants[0].name)
    command = reproduce_command(script, args, ("--framework", args.framework) if extra is None
                                else extra)
    publish(harness.markdown_section(
        title, command, machine, whole, notes(args, results, whole, steady),
        caption="Whole run (training wall time / steps):",
        tables=[(f"Steady state ({STEADY_SPAN}):", steady)]), args)
    return 0


def resnet_benchmark(description: str, jobs: Callable[[argparse.Namespace], Sequence[Job]],
                     section: Callable[[argparse.Namespace, dict[str, Any], Results], str],
                     key: str, argv: Sequence[str] | None = None) -> int:
    """Parses the ResNet options, runs ``jobs(args)`` interleaved, and publishes ``section``."""
    args = resnet_args(resnet_parser(description, 3, 20), argv)
    machine = harness.machine_record()
    results = run_jobs(jobs(args), args.rounds, args.warmup, key, args.timeout)
    publish(section(args, machine, results), args)
    return 0

