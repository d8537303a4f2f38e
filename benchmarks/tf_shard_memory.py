"""Peak resident memory per rank of TensorFlow sharded data parallel against the ring.

Run each setting under horovodrun (one launch each, so that one run's peak does not carry into
the next)::

    for s in ring ring-freed runtime shard.stage=1 shard.stage=2 shard.stage=3 \
        shard.stage=3,shard.reshard_after_forward=false; do
      .venv/bin/horovodrun -np 2 --gloo .venv/bin/python benchmarks/tf_shard_memory.py /tmp/mem $s
    done

It trains the digits MLP with 3 hidden layers of 4,096 (33.9 M parameters, Adam, batch 16 a rank)
for 12 steps and prints one JSON line per rank: its peak RSS (``ru_maxrss``), its peak from the
second step on (``steps_peak_mib``: ``VmHWM`` reset then, :class:`StepsPeak`), its peak before
that (``start_peak_mib``: building the model, the start-up broadcast, the first step), its
resident memory between steps (``between_mib``) and the seconds taken. Any rank count works
(``-np 4``); ZeRO's formula is per rank, so compare each count with its own ``runtime`` run.
``ring-freed`` is the ring with the allocators the sharded engine sets
(:func:`hvdtrain.tensorflow.shard.return_freed_memory`: the C library's, with freed blocks given
back); ``runtime`` the same process with hidden layers of 16 at ``shard.stage=1`` (what a rank
holds besides the model's states, subtracted before comparing with ZeRO's formula). A setting of
several overrides separates them with commas; ``deep/`` before a setting runs it on
:data:`DEEP`'s model.
docs/benchmarks.md ("TensorFlow sharded data parallel: peak memory per rank") holds the figures.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

from hvdtrain.config import load_config
from hvdtrain.driver import train
from hvdtrain.loop import Callback

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "digits_tf.yaml"
SETTINGS = ["model.options={hidden: [4096, 4096, 4096]}", "optim.name=adam", "optim.lr=0.0005",
            "train.max_steps=12", "data.batch_size=16", "train.epochs=1",
            "checkpoint.every_steps=1000", "log.console=false", "log.wandb=disabled",
            "log.overwrite=true"]
DEEP = "model.options={hidden: [2048, 2048, 2048, 2048, 2048, 2048, 2048, 2048]}"
"""``deep/SETTING``: 8 hidden layers of 2,048 (29.5 M parameters, 7 units of 16 MiB), where
stage 3 holds a few units gathered at once and a tape that kept every gathered unit would
hold them all."""
EXTRA = {"ring": [], "ring-freed": [],
         "runtime": ["model.options={hidden: [16, 16, 16]}", "shard.stage=1"]}


def high_water_mib() -> float:
    """This process's peak resident memory since the last :class:`StepsPeak` reset (Linux's
    ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def resident_mib() -> float:
    """This process's resident memory now (Linux's ``VmRSS``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class StepsPeak(Callback):
    """Resets the process's peak resident memory (``/proc/self/clear_refs``) when the second
    step starts, so that :func:`high_water_mib` at the end is the peak of the steps after the
    first (the first traces the step), the evaluation and the last checkpoint: not of building
    the model or of the start-up broadcast. Also notes the peak before that (``start_peak``:
    building, the broadcast, the first step and its tracing) and the resident memory when each
    later step starts (``between``: what a rank holds between steps, the last one's)."""

    def __init__(self) -> None:
        self.started = 0
        self.start_peak = self.between = float("nan")

    def on_step_start(self, step: int) -> None:
        self.started += 1
        if self.started == 2:
            self.start_peak = high_water_mib()
            Path("/proc/self/clear_refs").write_text("5")
        if self.started >= 2:
            self.between = resident_mib()


def main() -> None:
    out, setting = Path(sys.argv[1]), sys.argv[2]
    if setting == "ring-freed":  # before TensorFlow's first tensor
        from hvdtrain.tensorflow.shard import return_freed_memory
        return_freed_memory()
    rest = setting.removeprefix("deep/")
    extra = [DEEP] * (rest != setting) + EXTRA.get(rest, rest.split(","))
    cfg = load_config(CONFIG, [f"log.dir={out / setting.replace('/', '-')}", *SETTINGS, *extra],
                      environ={})
    began = time.perf_counter()
    probe = StepsPeak()
    result = train(cfg, callbacks=[probe])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"setting": setting, "rank": result.engine.rank,
                      "size": result.engine.size, "peak_mib": round(peak),
                      "start_peak_mib": round(probe.start_peak),
                      "steps_peak_mib": round(high_water_mib()),
                      "between_mib": round(probe.between),
                      "s": round(time.perf_counter() - began, 1)}), flush=True)


if __name__ == "__main__":
    main()
