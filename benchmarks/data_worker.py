"""The measured side of the input-pipeline benchmarks (``data.py``): hvdtrain trains through
``hvdtrain.driver.train`` and is observed through its public seams only (a loop
:class:`~hvdtrain.loop.Callback`, the run's ``summary.json`` and ``metrics.jsonl``).

- Loading (:data:`VARIANTS`, run by ``workload.job_main`` in one interleaved job): ResNet-18 on the
  JPEGs of ``$BENCH_DATA_ROOT`` read from disk by ``image_folder`` (with the default loader
  workers, or none), or the same images decoded once and preloaded in memory
  (:class:`PreloadedImages`, a dataset plug-in by import path). The record adds the steady share
  of step time spent waiting for data.
- Memory (this file's ``__main__`` under ``horovodrun``, one job a run, since a peak is a process's
  whole life): ``--epochs`` on an ``npy`` data set; rank 0 prints the peak memory of the worst rank.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's hvdtrain, even where none is installed

import numpy as np  # noqa: E402

import workload  # noqa: E402
from hvdtrain.config import load_config  # noqa: E402
from hvdtrain.data.contracts import BuiltDataset, DatasetSpec, Source, Split  # noqa: E402
from hvdtrain.data.image_folder import ImageFolder  # noqa: E402
from hvdtrain.driver import train  # noqa: E402
from hvdtrain.rundir import RunDir  # noqa: E402
from hvdtrain_worker import Clocked  # noqa: E402

CONFIGS = {"torch": ROOT / "configs" / "images_torch.yaml",
           "tensorflow": ROOT / "configs" / "images_tf.yaml"}
SIZE = 64
"""Pixels of the square images the model sees (the JPEGs are written at this size)."""
LOG_EVERY = 5
"""Steps per logged record (its ``data_wait_time_s`` and ``step_time_s`` are means over them)."""
SINKS = ["log.console=false", "log.wandb=disabled", "log.tensorboard=false", "log.system=false"]
"""Every sink off but ``metrics.jsonl``, which holds ``data_wait_time_s``."""


def env_setting(name: str) -> str:
    """A setting the driver passes to the interleaved job through the environment."""
    value = os.environ.get(name)
    if not value:
        raise SystemExit(f"{name} is not set: run benchmarks/data.py")
    return value


# Loading ------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=2)
def decoded(root: str, size: int) -> tuple[Split, Split, DatasetSpec]:
    """Both splits of the image folder decoded once per process, exactly as ``image_folder`` decodes
    them, as in-memory :class:`Split` objects."""
    folder = ImageFolder(root, size)

    def whole(source: Source) -> Split:
        batch = source.load(np.arange(len(source)))
        return Split(batch.x, batch.y)

    return whole(folder.train()), whole(folder.test()), folder.spec()


class PreloadedImages(BuiltDataset):
    """The images of an ``image_folder`` root, decoded before training and held in memory
    (``data.name: data_worker:PreloadedImages``): what ``image_folder`` loads from disk, minus
    the reading and decoding."""

    def __init__(self, root: str, size: int = SIZE) -> None:
        self._train, self._test, self._spec = decoded(root, size)



def wait_share(records: Sequence[dict[str, Any]], first_epoch: int = 0) -> float | None:
    """The share of step time spent waiting for data over the records of ``first_epoch`` on:
    each record's mean ``data_wait_time_s`` and ``step_time_s`` weighted by the steps it covers
    (the difference of consecutive ``step``). None when no record carries both."""
    waited = stepped = 0.0
    previous = 0
    for record in records:
        steps, previous = record["step"] - previous, record["step"]
        if record["epoch"] < first_epoch or "data_wait_time_s" not in record:
            continue
        waited += record["data_wait_time_s"] * steps
        stepped += record["step_time_s"] * steps
    return waited / stepped if stepped > 0 else None


def loading_overrides(framework: str, source: str, epochs: int,
                      log_dir: Path) -> list[str]:
    """The image config's overrides for one loading variant: ``memory``, ``disk`` (default
    workers) or ``disk0`` (no workers); no augmentation, one evaluation at the end, no
    checkpoint."""
    root, width = env_setting("BENCH_DATA_ROOT"), int(env_setting("BENCH_DATA_WIDTH"))
    if source == "memory":
        data = [f"data.name={Path(__file__).stem}:PreloadedImages",
                f"data.options={{root: {root}, size: {SIZE}}}"]
    else:
        data = ["data.name=image_folder", f"data.options={{root: {root}, size: {SIZE}}}",
                f"data.workers={0 if source == 'disk0' else -1}"]
    return [f"framework={framework}", "model.name=resnet18", f"model.options={{width: {width}}}",
            *data, f"data.batch_size={workload.BATCH_SIZE}", f"train.epochs={epochs}",
            "train.max_steps=0",
            f"train.eval_every_epochs={epochs}", "train.threads=0", "seed=0",
            "checkpoint.enabled=false", "checkpoint.every_steps=0",
            "log.overwrite=true", f"log.dir={log_dir}",
            f"log.every_steps={LOG_EVERY}", "log.jsonl=true", *SINKS]


def run_loading(framework: str, source: str, epochs: int, out_dir: Path) -> dict[str, Any]:
    """Trains one loading variant from scratch; returns this rank's record (``workload``'s, with
    ``data_wait_share`` over epochs 2 to N and ``data_wait_share_all`` over the whole run)."""
    cfg = load_config(CONFIGS[framework], loading_overrides(framework, source, epochs, out_dir),
                      environ={})
    clock = workload.Clock()
    result = train(cfg, callbacks=[Clocked(clock)])
    s = result.summary
    record = workload.measurement(result.engine.rank, s["steps"], s["samples"], s["wall_time_s"],
                                  s["final"].get("eval_accuracy"), clock, epochs)
    if result.engine.rank == 0:
        lines = RunDir(result.run_dir).metrics.read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        record["data_wait_share"] = wait_share(records, first_epoch=1 if epochs > 1 else 0)
        record["data_wait_share_all"] = wait_share(records)
    return record


VARIANTS = {f"{source}_{short}": functools.partial(run_loading, framework, source)
            for framework, short in (("torch", "torch"), ("tensorflow", "tf"))
            for source in ("memory", "disk", "disk0")}
"""Run functions by ``harness.Variant`` key: ``memory_torch``, ``disk_tf``, ``disk0_torch``..."""


# Memory -------------------------------------------------------------------------------------------

def rollup(pid: int | str) -> dict[str, int]:
    """``Pss`` and ``Pss_Anon`` of a process in kB (empty when it is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    fields = (line.split() for line in text.splitlines()[1:])
    return {f[0].rstrip(":"): int(f[1]) for f in fields if f and f[0] in ("Pss:", "Pss_Anon:")}


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the rank's loader workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # The command may hold spaces and parentheses: the fields follow the last ')'.
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


class PeakMemory:
    """Samples this rank and its child processes every ``interval`` seconds in a thread: the peak
    of their summed proportional set size (``Pss``: shared pages split among their sharers, so
    forked workers are not counted twice) and of its anonymous part (``Pss_Anon``: memory no file
    backs, which page cache and memory maps leave out)."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval, self.pss_kb, self.anon_kb = interval, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        """One sample: updates the peaks."""
        pid = os.getpid()
        rolls = [rollup(p) for p in (pid, *children(pid))]
        self.pss_kb = max(self.pss_kb, sum(r.get("Pss", 0) for r in rolls))
        self.anon_kb = max(self.anon_kb, sum(r.get("Pss_Anon", 0) for r in rolls))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> PeakMemory:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def memory_overrides(framework: str, root: Path, log_dir: Path, epochs: int = 1) -> list[str]:
    """``epochs`` of an MLP on the ``npy`` set at ``root`` (uint8 pixels), default workers, one
    evaluation at the end."""
    return [f"framework={framework}", "model.name=mlp", "model.options={hidden: [64]}",
            "data.name=npy", f"data.options={{root: {root}, scale: {1 / 255}}}",
            "data.workers=-1", "data.batch_size=64", f"train.epochs={epochs}",
            f"train.eval_every_epochs={epochs}", "train.max_steps=0",
            "train.threads=0", "seed=0", "checkpoint.enabled=false", "checkpoint.every_steps=0",
            "log.overwrite=true",
            f"log.dir={log_dir}", "log.jsonl=false", *SINKS]


def memory_main(argv: Sequence[str] | None = None) -> int:
    """One memory run on every rank; rank 0 prints ``{"rank_rss_mb", "tree_pss_mb",
    "tree_anon_mb", ...}``, each the largest over the ranks."""
    p = argparse.ArgumentParser(
        description="one memory run of benchmarks/data.py (under horovodrun)")
    p.add_argument("--framework", choices=sorted(CONFIGS), default="torch")
    p.add_argument("--root", type=Path, required=True, help="the npy data set")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=1)
    args = p.parse_args(argv)
    overrides = memory_overrides(args.framework, args.root, args.out_dir / "run", args.epochs)
    cfg = load_config(CONFIGS[args.framework], overrides, environ={})
    with PeakMemory() as peak:
        result = train(cfg)
    mine = {"rank_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "tree_pss_mb": peak.pss_kb / 1024, "tree_anon_mb": peak.anon_kb / 1024}
    every = result.engine.collectives.allgather_object(mine)
    if result.engine.rank == 0:
        worst = {key: max(figures[key] for figures in every) for key in mine}
        print(json.dumps({**worst, "samples": result.summary["samples"],
                          "world_size": result.engine.size}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(memory_main())
