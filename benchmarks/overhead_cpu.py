"""CPU time a step of the overhead benchmark's loops: what a loop costs the processor, not the wall.

``overhead.py`` judges step *time*, which on a loaded machine mostly measures the neighbours. This
job runs the same variants (the hand-written Horovod loop, the API loop or the trainer) interleaved
in one ``horovodrun`` job and clocks each step with CPU clocks instead: the main thread's
(``time.thread_time``: the Python loop itself, what hvdtrain adds a step) and the whole process's
(``time.process_time``: Horovod's background thread too). A variant's figures come from its own
``workload.Clock``, extended here to note the CPU clocks beside the wall clock at the same points,
so every variant is measured over the same span as ``overhead.py``'s: the steady state (epochs 2 to
N, up to the final evaluation) and the whole run (the first step through evaluation and checkpoint).

Usage (from the repository root; prints one JSON line per variant with medians over the rounds)::

    .venv/bin/python benchmarks/overhead_cpu.py --framework torch --rounds 20
    .venv/bin/python benchmarks/overhead_cpu.py --framework tensorflow --rounds 20
    .venv/bin/python benchmarks/overhead_cpu.py --framework torch --profile api   # cProfile, rank 0

``--candidate trainer`` measures ``hvdtrain train`` as B instead of the API loop.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
import workload  # noqa: E402

VARIANTS = {
    "torch": {"handwritten": "handwritten_torch:handwritten_torch", "api": "api_worker:api_torch",
              "trainer": "hvdtrain_worker:hvdtrain_torch"},
    "tensorflow": {"handwritten": "handwritten_tf:handwritten_tf", "api": "api_worker:api_tf",
                   "trainer": "hvdtrain_worker:hvdtrain_tf"},
}


class CpuClock(workload.Clock):
    """:class:`workload.Clock` that also notes the main thread's and the process's CPU time at
    each point it notes, and at its creation (just before a worker's loop starts)."""

    def __init__(self) -> None:
        super().__init__()
        self.created = (time.thread_time(), time.process_time())
        self.step_cpu: list[tuple[float, float]] = []
        self.eval_cpu: tuple[float, float] | None = None

    def step(self) -> None:
        self.step_cpu.append((time.thread_time(), time.process_time()))
        super().step()

    def evaluation(self) -> None:
        if self.eval_cpu is None:
            self.eval_cpu = (time.thread_time(), time.process_time())
        super().evaluation()


def cpu_figures(clock: CpuClock, epochs: int, steps: int) -> dict[str, float]:
    """Microseconds of CPU a step: steady state (epochs 2 to N) and whole run, for the main thread
    and the process, from the clock's notes and the present (the end of the worker's run)."""
    end = (time.thread_time(), time.process_time())
    skip = len(clock.step_cpu) // epochs
    assert clock.eval_cpu is not None, "the worker noted no evaluation"
    first, evaluation = clock.step_cpu[skip], clock.eval_cpu
    steady_steps = len(clock.step_cpu) - skip
    return {
        "steady_thread_us": 1e6 * (evaluation[0] - first[0]) / steady_steps,
        "steady_process_us": 1e6 * (evaluation[1] - first[1]) / steady_steps,
        "whole_thread_us": 1e6 * (end[0] - clock.created[0]) / steps,
        "whole_process_us": 1e6 * (end[1] - clock.created[1]) / steps,
        "first_epoch_thread_us": 1e6 * (first[0] - clock.created[0]) / skip,
        "tail_thread_ms": 1e3 * (end[0] - evaluation[0]),  # evaluation, checkpoint, close
        "tail_wall_ms": 1e3 * (time.perf_counter() - cast(float, clock.eval_start)),
    }


def instrumented_run(run: Callable[[int, Path], dict[str, Any]], epochs: int,
                     out_dir: Path) -> dict[str, Any]:
    """One ``run`` of a variant with :class:`CpuClock` in place of the workers' clock."""
    clocks: list[CpuClock] = []
    clock, measurement = workload.Clock, workload.measurement

    def make_clock() -> CpuClock:
        clocks.append(CpuClock())
        return clocks[-1]

    def measured(rank: int, steps: int, *args: Any) -> dict[str, Any]:
        record = measurement(rank, steps, *args)
        return {**record, **cpu_figures(clocks[-1], epochs, steps)}

    workload.Clock, workload.measurement = make_clock, measured  # type: ignore[assignment, misc]
    try:
        return run(epochs, out_dir)
    finally:
        workload.Clock, workload.measurement = clock, measurement  # type: ignore[misc]


def job(args: argparse.Namespace) -> int:
    """Under horovodrun: interleaved rounds of every variant; rank 0 prints each run's figures."""
    specs = [VARIANTS[args.framework][name] for name in ("handwritten", args.candidate)]
    specs.append(specs[0])  # A', the A/A control
    profile = VARIANTS[args.framework].get(args.profile or "")
    # Every variant imported up front, in order, as workload.job_main does (Horovod's process
    # sets follow the framework imported last).
    runs = {spec: workload.load_variant(spec) for spec in specs}
    for round_index in range(-args.warmup, args.rounds):
        for slot, spec in harness.round_order(list(enumerate(specs)), round_index):
            gc.collect()
            profiler = cProfile.Profile() if spec == profile and round_index >= 0 else None
            if profiler is not None:
                profiler.enable()
            record = instrumented_run(runs[spec], args.epochs, args.out_dir / f"slot{slot}")
            if profiler is not None:
                profiler.disable()
                if record["rank"] == 0:
                    pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(40)
            if record["rank"] == 0:
                print(json.dumps({"round": round_index, "slot": slot, "variant": spec, **record}),
                      flush=True)
    return 0


KEYS = ("steady_thread_us", "steady_process_us", "whole_thread_us", "whole_process_us",
        "first_epoch_thread_us", "tail_thread_ms", "tail_wall_ms")


def summary(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per slot (A, B, A'): the medians of :data:`KEYS` over the measured rounds, and B's and A''s
    ratios to A."""
    rows = []
    for slot in sorted({r["slot"] for r in records}):
        runs = [r for r in records if r["slot"] == slot and r["round"] >= 0]
        rows.append({"slot": slot, "variant": runs[0]["variant"], "runs": len(runs),
                     **{key: statistics.median(r[key] for r in runs) for key in KEYS}})
    for row in rows:
        row["ratio_to_A"] = {key: round(row[key] / rows[0][key], 3) for key in KEYS}
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=sorted(VARIANTS), default="torch")
    p.add_argument("--candidate", choices=("api", "trainer"), default="api")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--profile", choices=("handwritten", "api", "trainer"),
                   help="cProfile this variant's measured runs on rank 0 (to stderr)")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        return job(args)
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"overhead-cpu-{os.getpid()}"
    argv_job = [harness.horovodrun(), "-np", str(args.np), "--gloo", str(harness.python()),
                str(Path(__file__).resolve()), "--job", "--out-dir", str(out),
                *(sys.argv[1:] if argv is None else argv)]
    records = []
    proc = subprocess.run(argv_job, env=harness.worker_env(), text=True, stdout=subprocess.PIPE)
    for line in proc.stdout.splitlines():
        records.extend(harness.parse_measurements(line, "steady_thread_us"))
    if proc.returncode != 0 or not records:
        print(proc.stdout[-4000:], file=sys.stderr)
        return proc.returncode or 1
    print(f"load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
    for row in summary(records):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
