"""The benchmark workers' common ground: the problem they all train and how they report on it.

Every worker (``handwritten_torch.py``, ``handwritten_tf.py``, ``hvdtrain_worker.py``) takes its
hyper-parameters, its data split and its thread count from here, and builds and prints its
measurement with :func:`measurement` and :func:`report`, so the compared variants cannot drift
apart by an edit to one of them. This module
imports neither a deep-learning framework nor hvdtrain (the hand-written loops must stay free of
hvdtrain's code), and numpy only when data is loaded, so the drivers can read its constants.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def load_digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(train_x, train_y, test_x, test_y)`` of the digits, split exactly as hvdtrain's ``digits``.

    Pixels are scaled to [0, 1] as float32 and labels are int64, as ``hvdtrain.data.DigitsDataset``
    makes them; the split is stratified with a fixed seed.
    """
    # Imported here, not at the top: the drivers read this module's constants and must load fast.
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y.astype(np.int64), test_size=TEST_FRACTION,
                                          random_state=SPLIT_SEED, stratify=y)
    return xtr, ytr, xte, yte


def threads_per_rank(local_size: int) -> int:
    """Compute threads for one rank: the cores divided by the ranks on this host, at least one,
    and no more than the cores this process may run on (one under ``--bind``).

    hvdtrain's ``train.threads: 0`` uses the same rule (``hvdtrain.engine.compute_threads``),
    written again here because the hand-written loops must not import hvdtrain.
    """
    share = (os.cpu_count() or 1) // max(1, local_size)
    return max(1, min(len(os.sched_getaffinity(0)), share))


def local_rank() -> int:
    """This process's rank on its host, from the launcher's environment (Gloo's or Open MPI's)."""
    for name in ("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def bind_to_core() -> int:
    """Pins this process, and the threads and processes it starts later, to one core: its local
    rank modulo the cores it may use. Returns the core."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[local_rank() % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


SPIN_CODE = """
import os, sys
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
parent = int(sys.argv[1])
while os.getppid() == parent:  # ends by itself if its rank dies
    pass
"""


class IdleSpinner:
    """A busy loop in Linux's idle scheduling class beside this rank, on the cores it may use,
    for the ``with`` block (nothing when ``enabled`` is false).

    A core with nothing to run halts, and on this virtual machine waking it costs time: a rank
    waiting for an allreduce resumes later than on a busy core. Measured, an idle-class busy
    loop beside each rank made the same run 12% faster (interleaved, 10 rounds). Any variant that
    starts a background process (the metrics writer: ``hvdtrain.sinkproc``) gets some of that for
    free, so a benchmark comparing such variants gives every one of them the spinner. It runs
    only when nothing else wants the core, and training preempts it at once.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> IdleSpinner:
        if self.enabled:
            self._process = subprocess.Popen([sys.executable, "-c", SPIN_CODE, str(os.getpid())])
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()


def worker_parser(description: str) -> argparse.ArgumentParser:
    """A parser of the options every worker takes: ``--epochs`` and ``--out-dir``.

    The drivers pass both to every job; a worker may add its own options before parsing.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out-dir", default="",
                        help="where rank 0 writes its checkpoint or run (default: a new temp dir)")
    return parser


def out_dir(arg: str, prefix: str) -> Path:
    """``--out-dir`` as a path, or a fresh temporary directory when it was not given."""
    return Path(arg or tempfile.mkdtemp(prefix=prefix))


class Clock:
    """Notes when each optimizer step and the final evaluation start, for the steady-state figure.

    The whole-run wall time holds one-time costs: TensorFlow traces its ``tf.function`` step on
    the first call (seconds, against milliseconds per step), and the first steps of any framework
    touch cold memory. The steady state leaves the first epoch out: it runs from the start of the
    first step of the second epoch to the start of the final evaluation, so it holds every step of
    epochs 2 to N and all the work between them (metric logging, allreduces, shuffles), but no
    trace, evaluation or checkpoint. Every worker notes its times the same way, so the figures of
    the hand-written loops and of hvdtrain cover the same span.
    """

    def __init__(self) -> None:
        self.step_starts: list[float] = []
        self.eval_start: float | None = None

    def step(self) -> None:
        """Call at the start of every optimizer step."""
        self.step_starts.append(time.perf_counter())

    def evaluation(self) -> None:
        """Call at the start of the final evaluation (later calls are ignored)."""
        if self.eval_start is None:
            self.eval_start = time.perf_counter()

    def steady_seconds(self, epochs: int) -> float | None:
        """Seconds of epochs 2 to ``epochs`` (see the class); ``None`` for a one-epoch run."""
        skip = len(self.step_starts) // epochs  # every epoch has the same number of steps
        if epochs < 2 or self.eval_start is None or skip >= len(self.step_starts):
            return None
        return self.eval_start - self.step_starts[skip]

    def block_means(self, epochs: int, block: int, classes: int) -> list[float] | None:
        """Mean seconds per step of each block class, in the steady state: steps are numbered
        from 0, block ``b`` holds steps ``b * block`` to ``(b + 1) * block - 1``, and its class is
        ``b % classes``. Only blocks that lie wholly in the steady state count, and an odd number
        of them (the last is dropped when they are even): even and odd blocks then lie alike about
        the middle of the span, so a drift along the run (the machine slowing, or speeding up)
        weighs the same on both, and the averages of the even and of the odd classes compare them
        without it. (Whole cycles of ``classes`` blocks put the odd ones a block earlier on
        average: a steady slowing by 10% over a 40-epoch run read as odd / even 0.995.)

        For comparisons inside one run (``hvdtrain_worker.Alternation``, which mutes the even
        blocks): neighbouring blocks share the machine's state of the moment, which two runs
        seconds apart do not. ``None`` for a one-epoch run or one with fewer than ``classes``
        blocks in its steady state.
        """
        if epochs < 2 or self.eval_start is None:
            return None
        times = [*self.step_starts, self.eval_start]
        skip = len(self.step_starts) // epochs
        first = -(-skip // block)  # the first block that starts in the steady state
        count = len(self.step_starts) // block - first
        count -= 1 - count % 2  # odd
        if count < classes:
            return None
        sums, blocks = [0.0] * classes, [0] * classes
        for b in range(first, first + count):
            sums[b % classes] += times[(b + 1) * block] - times[b * block]
            blocks[b % classes] += 1
        return [total / (n * block) for total, n in zip(sums, blocks)]


def measurement(rank: int, steps: int, wall_time_s: float, eval_loss: float | None,
                eval_accuracy: float | None, *, clock: Clock, epochs: int,
                **extra: Any) -> dict[str, Any]:
    """The measurement every worker returns from ``run`` on every rank, with ``extra`` keys appended.

    ``rank`` says whose clock it is (only rank 0's is reported). ``step_time_s`` is the wall time
    per optimizer step; ``steady_step_time_s`` is the steady state's time (see :class:`Clock`) per
    step it holds, ``None`` for a one-epoch run.
    """
    steady = clock.steady_seconds(epochs)
    steady_steps = steps - steps // epochs
    return {"rank": rank, "steps": steps, "wall_time_s": wall_time_s,
            "step_time_s": wall_time_s / steps,
            "steady_step_time_s": None if steady is None else steady / steady_steps,
            "eval_loss": eval_loss, "eval_accuracy": eval_accuracy, **extra}


def report(record: dict[str, Any]) -> None:
    """On rank 0 only, prints ``record`` as a JSON line, as ``harness.parse_measurements`` reads it.

    Every rank measures; one report per run is enough, and rank 0's is the one hvdtrain's run
    summary (written by rank 0) also gives.
    """
    if record["rank"] == 0:
        print(json.dumps(record), flush=True)
