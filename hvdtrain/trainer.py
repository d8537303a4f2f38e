"""``train(cfg)``: the whole run on one rank, from plug-in checks to ``summary.json``.

Every rank calls it (under ``horovodrun`` or alone). Nothing is written before the config, the
dataset and the model have been checked and built, so a mistake leaves no half-made run directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdtrain.checkpoint import CheckpointManager, atomic_write
from hvdtrain.config import Config, save_config
from hvdtrain.data import Dataset
from hvdtrain.engine import Engine, make_engine
from hvdtrain.errors import HvdtrainError
from hvdtrain.loop import Loop, Position
from hvdtrain.observe.records import make_logger
from hvdtrain.observe.watchdog import StallWatchdog
from hvdtrain.registry import DATASETS, MODELS
from hvdtrain.resume import find_checkpoint, restore, trim_metrics
from hvdtrain.signals import StopRequest

RUN_FILES = ("metrics.jsonl", "summary.json", "config.yaml")


@dataclass
class TrainResult:
    """What a finished run returns on every rank."""

    summary: dict[str, Any]
    run_dir: Path
    local_eval: dict[str, float]
    """This rank's own evaluation sums, before the cross-rank allreduce."""
    engine: Engine


def make_dataset(cfg: Config) -> Dataset:
    """Instantiates the configured dataset with ``data.options``."""
    cls = DATASETS.get(cfg.data.name)
    try:
        dataset = cls(**cfg.data.options)
    except TypeError as exc:
        raise HvdtrainError(f"data.options for {cfg.data.name!r}: {exc}") from None
    if not isinstance(dataset, Dataset):
        raise HvdtrainError(f"data.name={cfg.data.name!r} is not a hvdtrain.data.Dataset")
    return dataset


def check_run_dir(cfg: Config) -> None:
    """Refuses to mix two runs in one directory unless asked to overwrite.

    Checked on every rank before Horovod starts, so that no rank is left waiting in a collective
    for a rank 0 that stopped here.
    """
    run_dir = cfg.run_dir
    existing = [name for name in RUN_FILES if (run_dir / name).exists()]
    if existing and not cfg.log.overwrite:
        raise HvdtrainError(f"run directory {str(run_dir)!r} already holds a run ({existing[0]}); "
                            "set log.overwrite=true or choose another log.dir")


def prepare_run_dir(cfg: Config, writer: bool, resumed: Position | None = None) -> Path:
    """Creates the run directory on rank 0 and saves the config; a fresh run replaces an earlier
    run's files, a resumed one keeps them and drops only metrics logged after its checkpoint."""
    run_dir = cfg.run_dir
    if not writer:
        return run_dir
    if resumed is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        trim_metrics(run_dir / "metrics.jsonl", resumed.step)
        save_config(cfg, run_dir / "config.yaml")
        return run_dir
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for old in (run_dir / "checkpoints").glob("step-*"):  # checkpoints and their manifests
        old.unlink()
    save_config(cfg, run_dir / "config.yaml")
    return run_dir


def train(cfg: Config) -> TrainResult:
    """Trains ``cfg`` on this rank and returns the result; rank 0 writes the run directory."""
    DATASETS.check(cfg.data.name)
    MODELS[cfg.framework].check(cfg.model.name)
    resume_from = find_checkpoint(cfg, cfg.run_dir)
    if cfg.elastic.enabled:
        from hvdtrain.elastic import train_elastic  # imports Horovod's elastic machinery
        return train_elastic(cfg, resume_from)
    if resume_from is None:
        check_run_dir(cfg)
    dataset = make_dataset(cfg)
    engine = make_engine(cfg.framework)
    engine.prepare(cfg, dataset)
    start = restore(engine, resume_from, cfg)
    engine.broadcast_state()
    writer = engine.rank == 0
    run_dir = prepare_run_dir(cfg, writer, start)
    checkpoints = CheckpointManager(cfg.checkpoint, run_dir / "checkpoints", writer=writer)
    watchdog = StallWatchdog(cfg.train.stall_timeout_s, run_dir, engine.rank, engine.size,
                             before_exit=lambda: logger.flush())  # the logger made below
    with StopRequest() as stop, watchdog as dog:
        loop = Loop(cfg, engine, dataset, checkpoints, start, stop, dog.beat)
        logger = make_logger(cfg, run_dir, writer, loop.total_steps, start_step=loop.pos.step,
                             resumed=start is not None)
        try:
            summary = loop.run(logger)
            logger.summary(summary)
        finally:
            logger.close()
            checkpoints.wait()  # the last checkpoint is on disk before the run ends or stops
    if writer:
        write_summary(run_dir, summary)
    return TrainResult(summary=summary, run_dir=run_dir, local_eval=loop.local_eval, engine=engine)


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """Writes ``summary.json`` atomically (rank 0)."""
    text = json.dumps(summary, indent=2, sort_keys=True) + "\n"
    atomic_write(run_dir / "summary.json", lambda f: f.write(text.encode()))
