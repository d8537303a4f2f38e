"""The measured side of the benchmarks: hvdtrain's PyTorch or TensorFlow trainer on the bench problem.

Loads ``configs/digits_torch.yaml`` or ``configs/digits_tf.yaml`` with overrides that make the run do
the same work as ``handwritten_torch.py`` / ``handwritten_tf.py`` (the settings of
:mod:`workload`, a constant learning rate ``0.05 x size``, no warm-up, one evaluation and one
checkpoint at the end), and keeps what hvdtrain always does (metrics averaged over ranks and written
to ``metrics.jsonl`` every ``log.every_steps``, atomic checkpoint), since that is its overhead. The
two frameworks get the same overrides, so they also run the same work as each other.

Run under ``horovodrun -np 2 --gloo python scripts/bench/hvdtrain_worker.py --framework tensorflow
--epochs 10``, or call :func:`run` (``interleaved.py`` does, many times in one job). Rank 0 prints
one JSON line with the hand-written workers' keys (``rank``, ``steps``, ``wall_time_s`` and
``step_time_s``, from the run summary, whose wall time covers the loop from the first step through
the final evaluation and checkpoint; ``steady_step_time_s``, see :class:`workload.Clock`;
``eval_loss``, ``eval_accuracy``), three more for ``frameworks.py``: ``samples``,
``samples_per_s`` (over the whole run) and ``steady_samples_per_s``, and ``block_means_s``
for ``monitoring.py`` (:meth:`workload.Clock.block_means`, :class:`Alternation`).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[2]
# Run from a checkout, the worker must find this checkout's hvdtrain even if none is installed.
sys.path.insert(0, str(ROOT))

import hvdtrain.trainer  # noqa: E402
import workload  # noqa: E402
from hvdtrain.config import load_config  # noqa: E402
from hvdtrain.engine import Engine, make_engine  # noqa: E402
from hvdtrain.loop import Loop  # noqa: E402
from hvdtrain.observe.records import MetricsLogger  # noqa: E402
from hvdtrain.observe.system import SystemSampler  # noqa: E402
from workload import (BASE_LR, BATCH_SIZE, EVAL_BATCH_SIZE, HIDDEN, MOMENTUM, SEED,  # noqa: E402
                      SPLIT_SEED, TEST_FRACTION)

CONFIGS = {"torch": ROOT / "configs" / "digits_torch.yaml",
           "tensorflow": ROOT / "configs" / "digits_tf.yaml"}


LOG_EVERY = 10
"""Steps per logged record (the config's default, pinned here for ``monitoring.py``)."""

SINKS = {
    # The hand-written loops log nothing; W&B's service process is not training machinery.
    "default": ["log.console=false", "log.wandb=disabled"],
    # monitoring.py compares every sink and the system sampling off against all of them on.
    "off": ["log.console=false", "log.wandb=disabled", "log.jsonl=false", "log.tensorboard=false",
            "log.system=false"],
    "on": ["log.console=true", "log.progress=lines", "log.wandb=offline", "log.jsonl=true",
           "log.tensorboard=true", "log.system=true"],
}
"""Logging overrides by ``sinks`` option of :func:`run`."""
SINKS["alternate"] = SINKS["on"]  # muted by turns during the run: see Alternation
SINKS["alternate_off"] = SINKS["off"]  # the same blocks with nothing to mute: the A/A control

BLOCK_EPOCHS = 2
"""Epochs per block of :class:`Alternation`: 46 steps of the bench problem at 2 ranks (23 an
epoch), about 0.2 s, with four or five records at ``LOG_EVERY`` and two epoch ends. Whole epochs,
so that every block does the same work: blocks of 50 steps held 2 or 3 epoch ends (each with a
metrics allreduce waited for at once, and a reshuffle), and in a 40-epoch run the live blocks
held 2.33 a block on average, the muted ones 2.0. The writer process gets at most one record a
second (``log.dashboard_every_s``) and finishes it within tens of milliseconds, so its Python
work lands in the live block too (when it was handed every record it
ran up to 1.5 s behind, on muted and live blocks alike). W&B's service, which works on the record
after the writer, was not traced."""
BLOCK_CLASSES = 4
"""Blocks take these classes in turn: muted (A), live (B), muted (A'), live (B again)."""


class Alternation:
    """In a run with every sink on, mutes the sinks in every other block of :data:`BLOCK_EPOCHS`
    epochs, for a comparison inside one run (``workload.Clock.block_means``).

    Muted: rank 0 hands no record to its sinks (``MetricsLogger.log``: no JSON line, console
    line, TensorBoard event or W&B record) and no rank samples its CPU, memory or GPU
    (``SystemSampler.sample`` repeats its last reading, so the allreduce carries the same keys).
    The metrics allreduce runs in every block, as it does with every sink off. What a muted block
    keeps is the open sinks: the writer process and W&B's service, idle, waiting on their input.
    Every rank counts the same epochs, so all ranks mute the same blocks.
    """

    def __init__(self) -> None:
        self.epochs_done = 0

    def muted(self) -> bool:
        """Whether the epoch in progress is in a muted block (even blocks, counted from 0)."""
        return (self.epochs_done // BLOCK_EPOCHS) % 2 == 0

    def epoch_ended(self) -> None:
        """Counts an epoch, after its end (its last record and sample are in its own block)."""
        self.epochs_done += 1

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Muting in force for the ``with`` block (it patches three methods, then restores them:
        the two that it mutes, and the loop's epoch end, which it counts)."""
        log, sample, end_epoch = MetricsLogger.log, SystemSampler.sample, Loop._end_epoch
        last: dict[int, dict[str, float]] = {}

        def muted_log(logger: MetricsLogger, record: dict[str, Any]) -> None:
            if not self.muted():
                log(logger, record)

        def muted_sample(sampler: SystemSampler) -> dict[str, float]:
            if not self.muted() or id(sampler) not in last:
                last[id(sampler)] = sample(sampler)
            return last[id(sampler)]

        def counted_end_epoch(loop: Loop, *args: Any, **kwargs: Any) -> None:
            try:
                end_epoch(loop, *args, **kwargs)
            finally:
                self.epoch_ended()

        MetricsLogger.log, SystemSampler.sample = muted_log, muted_sample  # type: ignore[method-assign]
        Loop._end_epoch = counted_end_epoch  # type: ignore[method-assign]
        try:
            yield
        finally:
            MetricsLogger.log, SystemSampler.sample = log, sample  # type: ignore[method-assign]
            Loop._end_epoch = end_epoch  # type: ignore[method-assign]


def overrides(framework: str, epochs: int, log_dir: str, sinks: str = "default") -> list[str]:
    """Config overrides that pin every setting the hand-written loops hard-code, and the sinks."""
    return [
        f"framework={framework}", "model.name=mlp", f"model.options.hidden=[{HIDDEN}]",
        "data.name=digits", f"data.options.test_fraction={TEST_FRACTION}",
        f"data.options.split_seed={SPLIT_SEED}", f"train.epochs={epochs}", "train.max_steps=0",
        "train.threads=0", "train.backward_passes_per_step=1",
        # The hand-written loops evaluate once, after the last epoch.
        f"train.eval_every_epochs={epochs}",
        f"seed={SEED}", f"data.batch_size={BATCH_SIZE}", f"data.eval_batch_size={EVAL_BATCH_SIZE}",
        "data.shuffle=true", "optim.name=sgd", f"optim.lr={BASE_LR}", "optim.scale_lr=true",
        f"optim.momentum={MOMENTUM}", "optim.weight_decay=0", "optim.warmup_steps=0",
        "optim.schedule=constant", "comm.compression=none",
        # One checkpoint, at the end, like the hand-written save.
        "checkpoint.enabled=true", "checkpoint.every_steps=0",
        "log.overwrite=true", f"log.dir={log_dir}", f"log.every_steps={LOG_EVERY}", *SINKS[sinks],
    ]


def train_clocked(cfg: Any, clock: workload.Clock) -> Any:
    """``hvdtrain.trainer.train(cfg)`` with ``clock`` riding on the engine it builds."""
    # train() builds its engine through this module-level name; the clock must ride on that engine.
    original = hvdtrain.trainer.make_engine
    hvdtrain.trainer.make_engine = clocked(clock)
    try:
        return hvdtrain.trainer.train(cfg)
    finally:
        hvdtrain.trainer.make_engine = original


def clocked(clock: workload.Clock) -> Callable[[str], Engine]:
    """A ``make_engine`` whose engines note on ``clock`` when each step and evaluation starts.

    It wraps the engine's public ``train_step`` and ``evaluate`` (one Python call and one
    ``perf_counter`` per step, well under a microsecond against milliseconds per step), so hvdtrain
    is timed over the same span as the hand-written loops, which note the same points inline.
    """
    def make(framework: str) -> Engine:
        engine = make_engine(framework)
        train_step, evaluate = engine.train_step, engine.evaluate

        def timed_step(*args: Any, **kwargs: Any) -> dict[str, float]:
            clock.step()
            return train_step(*args, **kwargs)

        def timed_evaluate(*args: Any, **kwargs: Any) -> dict[str, float]:
            clock.evaluation()
            return evaluate(*args, **kwargs)

        engine.train_step, engine.evaluate = timed_step, timed_evaluate  # type: ignore[method-assign]
        return engine

    return make


def throughput(summary: dict[str, Any], clock: workload.Clock, epochs: int) -> dict[str, Any]:
    """``samples``, ``samples_per_s`` (over the whole run) and ``steady_samples_per_s``.

    Every epoch sees every training sample once, so the steady state (epochs 2 to N, see
    :class:`workload.Clock`) holds ``(epochs - 1) / epochs`` of the run's samples.
    """
    samples = summary["samples"]
    steady_seconds = clock.steady_seconds(epochs)
    steady = None if steady_seconds is None else samples * (epochs - 1) / epochs / steady_seconds
    return {"samples": samples, "samples_per_s": samples / summary["wall_time_s"],
            "steady_samples_per_s": steady}


def run(framework: str, epochs: int, out_dir: Path, sinks: str = "default") -> dict[str, Any]:
    """Trains from scratch with hvdtrain (rank 0 writes the run to ``out_dir``); returns a measurement.

    The measurement is this rank's. Every call loads the config and lets hvdtrain build a new engine (model, optimizer, data order,
    seeds), so repeated calls in one process (``interleaved.py``) are independent and alike.
    """
    # environ={}: HVDTRAIN_* variables of the caller must not change what is measured.
    cfg = load_config(CONFIGS[framework], overrides(framework, epochs, str(out_dir), sinks),
                      environ={})
    clock = workload.Clock()
    with Alternation().active() if sinks.startswith("alternate") else contextlib.nullcontext():
        result = train_clocked(cfg, clock)
    summary = result.summary
    record = workload.measurement(result.engine.rank, summary["steps"], summary["wall_time_s"],
                                  summary["final"].get("eval_loss"),
                                  summary["final"].get("eval_accuracy"), clock=clock, epochs=epochs)
    return {**record, **throughput(summary, clock, epochs),
            "block_means_s": clock.block_means(epochs, BLOCK_EPOCHS * summary["steps"] // epochs,
                                               BLOCK_CLASSES)}


def main() -> None:
    """Parses the arguments, trains once with hvdtrain, and prints the measurement on rank 0."""
    parser = workload.worker_parser(__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=sorted(CONFIGS), default="torch")
    args = parser.parse_args()
    workload.report(run(args.framework, args.epochs,
                        workload.out_dir(args.out_dir, "hvdtrain-bench-")))


if __name__ == "__main__":
    main()
