"""The problem every step-time worker trains, how each clocks itself, what it reports, and the
interleaved job that runs them (:func:`job_main`, this file's entry point under ``horovodrun``).

``handwritten_torch.py``, ``handwritten_tf.py`` and ``hvdtrain_worker.py`` take their
hyper-parameters, data split and thread count from here and build their record with
:func:`measurement`, so the compared variants cannot drift apart by an edit to one of them. It
imports neither a framework nor hvdtrain (the hand-written loops must stay free of hvdtrain's code),
and numpy only when data is loaded, so the drivers can read its constants and notes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import harness

if TYPE_CHECKING:
    import numpy as np

BATCH_SIZE = 32
"""Samples per rank per optimizer step."""
EVAL_BATCH_SIZE = 256
BASE_LR = 0.05
"""One rank's learning rate; every worker scales it by the world size."""
MOMENTUM = 0.9
SEED = 0
HIDDEN = 128
"""Width of the MLP's one hidden layer (64 inputs, 10 classes)."""
SPLIT_SEED = 0
TEST_FRACTION = 0.2
LOG_EVERY = 10
"""hvdtrain's steps per logged record (``log.every_steps``)."""

SINKS = {
    # The hand-written loops log nothing; W&B's service process is not training machinery.
    "default": ["log.console=false", "log.wandb=disabled"],
    "off": ["log.console=false", "log.wandb=disabled", "log.jsonl=false", "log.tensorboard=false",
            "log.system=false"],
    "on": ["log.console=true", "log.progress=lines", "log.wandb=offline", "log.jsonl=true",
           "log.tensorboard=true", "log.system=true"],
}
"""hvdtrain's logging switches by ``hvdtrain_worker.run``'s ``sinks``: the default, every sink
off, every sink on (``monitoring.py`` compares the last two)."""


def load_digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(train_x, train_y, test_x, test_y)`` of the digits, split as hvdtrain's ``digits``:
    pixels scaled to [0, 1] as float32, int64 labels, a stratified split with a fixed seed."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y.astype(np.int64), test_size=TEST_FRACTION,
                                          random_state=SPLIT_SEED, stratify=y)
    return xtr, ytr, xte, yte


def threads_per_rank(local_size: int) -> int:
    """Compute threads for one rank: the cores over the ranks on this host, at least one, at most
    the cores this process may run on. hvdtrain's ``train.threads: 0`` follows the same rule
    (``hvdtrain.engine.compute_threads``), written again because these loops must not import it."""
    share = (os.cpu_count() or 1) // max(1, local_size)
    return max(1, min(len(os.sched_getaffinity(0)), share))


class Clock:
    """Notes when each optimizer step and the final evaluation start.

    The whole-run time holds one-time costs (TensorFlow traces its step on the first call, the
    first steps touch cold memory). The steady state leaves the first epoch out: from the start of
    the first step of epoch 2 to the start of the final evaluation, every step and the work between
    steps (metric logging, allreduces, shuffles), but no trace, evaluation or checkpoint. Every
    worker notes the same two points, so their figures cover the same span.
    """

    def __init__(self) -> None:
        self.step_starts: list[float] = []
        self.eval_start: float | None = None
        self.startup_s: float | None = None  # the process's age at the end of the first step

    def step(self) -> None:
        """Call at the start of every optimizer step."""
        self.step_starts.append(time.perf_counter())
        if len(self.step_starts) == 2:
            self.startup_s = process_age_s()

    def evaluation(self) -> None:
        """Call at the start of the final evaluation (later calls are ignored)."""
        if self.eval_start is None:
            self.eval_start = time.perf_counter()

    def steady_seconds(self, epochs: int) -> float | None:
        """Seconds of epochs 2 to ``epochs``; ``None`` for a one-epoch run or without evaluation."""
        skip = len(self.step_starts) // epochs  # every epoch has the same number of steps
        if epochs < 2 or self.eval_start is None or skip >= len(self.step_starts):
            return None
        return self.eval_start - self.step_starts[skip]


def process_age_s() -> float:
    """Seconds since this process started, as ``hvdtrain.observe.system.process_age_s`` reads them
    (written again here: the hand-written loops must not load hvdtrain's code)."""
    with open("/proc/self/stat", "rb") as fileobj:
        stat = fileobj.read()
    start_ticks = int(stat[stat.rindex(b")") + 2:].split()[19])
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")


def measurement(rank: int, steps: int, samples: int, wall_time_s: float, eval_accuracy: float,
                clock: Clock, epochs: int) -> dict[str, Any]:
    """One run's record on this rank: ``step_time_s`` and ``samples_per_s`` over the whole run,
    and their steady-state counterparts (``None`` for a one-epoch run).

    Every epoch has the same steps and samples, so the steady state holds ``(epochs - 1) /
    epochs`` of each.
    """
    steady = clock.steady_seconds(epochs)
    share = (epochs - 1) / epochs
    return {"rank": rank, "steps": steps, "samples": samples, "wall_time_s": wall_time_s,
            "step_time_s": wall_time_s / steps, "samples_per_s": samples / wall_time_s,
            "steady_step_time_s": None if steady is None else steady / (steps * share),
            "steady_samples_per_s": None if steady is None else samples * share / steady,
            "eval_accuracy": eval_accuracy, "startup_s": clock.startup_s}


def report(record: Mapping[str, Any]) -> None:
    """On rank 0 only, prints ``record`` as one JSON line (``harness.parse_measurements``)."""
    if record["rank"] == 0:
        print(json.dumps(record), flush=True)


STEADY_SPAN = "epochs 2 to N, up to the final evaluation"


def notes(args: Any, results: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """The lines every step-time section carries: the workload, the two spans, each variant's
    median one-time cost and final accuracy (every variant trains the same problem)."""
    steps = next(iter(results.values()))[0]["steps"]
    def one_time(m: Mapping[str, Any]) -> float:
        return m["wall_time_s"] - m["steady_step_time_s"] * m["steps"]

    costs = ", ".join(f"{name} {statistics.median(map(one_time, runs)):.3f} s"
                      for name, runs in results.items())
    accuracy = ", ".join(f"{name} {statistics.median(m['eval_accuracy'] for m in runs):.3f}"
                         for name, runs in results.items())
    return [
        f"Workload: digits MLP (64-{HIDDEN}-10), all runs in one `horovodrun -np {args.np} "
        f"--{args.controller}` job, batch {BATCH_SIZE} per rank, SGD lr {BASE_LR} x {args.np} "
        f"momentum {MOMENTUM}; {args.epochs} epochs ({steps} steps) a run; {args.rounds} rounds "
        f"after {args.warmup} warm-up.",
        "Whole run: from the first step through the final evaluation and checkpoint, on rank 0. "
        f"Steady state: {STEADY_SPAN} (`workload.Clock`; hvdtrain's through a "
        "`hvdtrain.loop.Callback`).",
        f"Median one-time cost a run (whole run less steady step time x steps): {costs}.",
        f"Median final test accuracy: {accuracy}.",
    ]


# The interleaved job (under horovodrun) -----------------------------------------------------------

SPIN_CODE = """
import os, sys
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
parent = int(sys.argv[1])
while os.getppid() == parent:  # ends by itself if its rank dies
    pass
"""


@contextlib.contextmanager
def idle_spinner(enabled: bool) -> Iterator[None]:
    """A busy loop in Linux's idle scheduling class beside this rank for the ``with`` block.

    A virtual core with nothing to run halts and is slow to wake, so a rank waiting for an
    allreduce resumes later than on a busy core; a variant that starts a helper process (the
    dashboards' writer) would keep its cores awake and gain from that alone. The spinner gives
    every variant awake cores; training preempts it at once.
    """
    argv = [sys.executable, "-c", SPIN_CODE, str(os.getpid())]
    spinner = subprocess.Popen(argv) if enabled else None
    try:
        yield
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def bind_to_core() -> int:
    """Pins this process (and what it starts later) to one core: its local rank modulo the cores
    it may use. Returns the core."""
    local = int(os.environ.get("HOROVOD_LOCAL_RANK") or os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK")
                or 0)
    cores = sorted(os.sched_getaffinity(0))
    core = cores[local % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def load_variant(spec: str) -> Callable[[int, Path], dict[str, Any]]:
    """The run function of ``module:key``: ``VARIANTS[key]`` of that worker module, imported now
    (so a PyTorch job never loads TensorFlow)."""
    module, key = spec.split(":")
    return importlib.import_module(module).VARIANTS[key]


def job_main(argv: Sequence[str] | None = None) -> int:
    """The interleaved job, on every rank: ``--warmup`` discarded rounds, then ``--rounds``
    measured ones, each running every variant once in :func:`round_order`. A run returns this
    rank's record; rank 0 prints it with ``round``, ``slot`` and ``variant`` added."""
    p = argparse.ArgumentParser(description="one interleaved benchmark job (under horovodrun)")
    p.add_argument("--variants", required=True, help="comma-separated module:key")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--bind", action="store_true")
    p.add_argument("--spin", action="store_true")
    args = p.parse_args(argv)
    if args.bind:
        bind_to_core()
    specs = args.variants.split(",")
    runs = {spec: load_variant(spec) for spec in specs}
    with idle_spinner(args.spin):
        for round_index in range(-args.warmup, args.rounds):
            for slot, spec in harness.round_order(list(enumerate(specs)), round_index):
                gc.collect()  # the last run's garbage is collected here, not in the next one's time
                record = runs[spec](args.epochs, args.out_dir / f"slot{slot}")
                if record["rank"] == 0:
                    print(json.dumps({"round": round_index, "slot": slot, "variant": spec,
                                      **record}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(job_main())
