"""The measured side of the step-time benchmarks: hvdtrain's trainer on the problem.

Loads ``configs/digits_torch.yaml`` or ``configs/digits_tf.yaml`` with overrides that make a run do
the work of ``handwritten_torch.py`` / ``handwritten_tf.py`` (the settings of :mod:`workload`, a
constant learning rate, one evaluation and one checkpoint at the end) and keep what hvdtrain always
does (metrics averaged over ranks every ``log.every_steps``, an atomic checkpoint), since that is
its overhead. The sinks are set by config switches only (``workload.SINKS``). The run is timed
through the loop's public callbacks (:class:`Clocked`), over the same span as the hand-written
loops.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Run from a checkout, the worker must find this checkout's hvdtrain even if none is installed.
sys.path.insert(0, str(ROOT))

import workload  # noqa: E402
from hvdtrain.config import Config, load_config  # noqa: E402
from hvdtrain.driver import TrainResult, train  # noqa: E402
from hvdtrain.loop import Callback  # noqa: E402

CONFIGS = {"torch": ROOT / "configs" / "digits_torch.yaml",
           "tensorflow": ROOT / "configs" / "digits_tf.yaml"}


class Clocked(Callback):
    """Notes on a :class:`workload.Clock` when each step and the first evaluation start."""

    def __init__(self, clock: workload.Clock) -> None:
        self.clock = clock

    def on_step_start(self, step: int) -> None:
        self.clock.step()

    def on_evaluate_start(self) -> None:
        self.clock.evaluation()


def overrides(framework: str, epochs: int, log_dir: Path, sinks: str = "default") -> list[str]:
    """Config overrides that pin every setting the hand-written loops hard-code, and the sinks."""
    w = workload
    return [
        f"framework={framework}", "model.name=mlp", f"model.options.hidden=[{w.HIDDEN}]",
        "data.name=digits", f"data.options.test_fraction={w.TEST_FRACTION}",
        f"data.options.split_seed={w.SPLIT_SEED}", f"train.epochs={epochs}", "train.max_steps=0",
        "train.threads=0", "train.backward_passes_per_step=1", f"train.eval_every_epochs={epochs}",
        f"seed={w.SEED}", f"data.batch_size={w.BATCH_SIZE}",
        f"data.eval_batch_size={w.EVAL_BATCH_SIZE}", "data.shuffle=true", "optim.name=sgd",
        f"optim.lr={w.BASE_LR}", "optim.scale_lr=true", f"optim.momentum={w.MOMENTUM}",
        "optim.weight_decay=0", "optim.warmup_steps=0", "optim.schedule=constant",
        "comm.compression=none", "checkpoint.enabled=true", "checkpoint.every_steps=0",
        "log.overwrite=true", f"log.dir={log_dir}", f"log.every_steps={w.LOG_EVERY}",
        *w.SINKS[sinks],
    ]


def train_clocked(cfg: Config) -> tuple[TrainResult, workload.Clock]:
    """``hvdtrain.driver.train(cfg)`` with a :class:`Clocked` callback; the result and clock."""
    clock = workload.Clock()
    return train(cfg, callbacks=[Clocked(clock)]), clock


def run(framework: str, epochs: int, out_dir: Path, sinks: str = "default") -> dict[str, Any]:
    """Trains from scratch (rank 0 writes the run to ``out_dir``); returns this rank's record.

    Every call loads the config and lets hvdtrain build a new engine, so repeated calls in one
    process are independent and alike. ``environ={}``: the caller's HVDTRAIN_* variables must
    not change what is measured.
    """
    cfg = load_config(CONFIGS[framework], overrides(framework, epochs, out_dir, sinks), environ={})
    result, clock = train_clocked(cfg)
    s = result.summary
    return workload.measurement(result.engine.rank, s["steps"], s["samples"], s["wall_time_s"],
                                s["final"].get("eval_accuracy"), clock, epochs)


VARIANTS = {f"{kind}_{short}": functools.partial(run, framework, sinks=sinks)
            for framework, short in (("torch", "torch"), ("tensorflow", "tf"))
            for kind, sinks in (("hvdtrain", "default"), ("sinks_off", "off"), ("sinks_on", "on"))}
"""This worker's run functions by ``harness.Variant`` key: ``hvdtrain_torch``, ``sinks_on_tf``..."""
