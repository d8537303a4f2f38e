"""Resuming a run: which checkpoint, restoring it on rank 0, and telling every rank where to start.

Only rank 0 reads the checkpoint (other hosts may not see its file system); the engine's broadcast
then gives every rank its state, and one allreduce gives them its position, so a run written at one
world size resumes at another.
"""

from __future__ import annotations

import json
from pathlib import Path

from hvdtrain.checkpoint import CheckpointManager, verify
from hvdtrain.config import Config
from hvdtrain.engine import Engine
from hvdtrain.errors import HvdtrainError
from hvdtrain.loop import Position

_FIELDS = ("step", "epoch", "in_epoch", "samples")


def find_checkpoint(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint that ``checkpoint.resume`` asks for, or None to start afresh."""
    resume = cfg.checkpoint.resume
    if resume == "none":
        return None
    if resume == "auto":
        manager = CheckpointManager(cfg.checkpoint, run_dir / "checkpoints", writer=False)
        return manager.latest_valid()
    path = Path(resume)
    problem = verify(path) if path.is_file() else "no such file"
    if problem:
        raise HvdtrainError(f"checkpoint.resume={resume!r}: {problem}")
    return path


def read_position(engine: Engine, path: Path, cfg: Config) -> Position:
    """Restores the checkpoint ``path`` into this rank's engine (no communication) and returns
    where it stood; raises :class:`HvdtrainError` when it does not fit this run."""
    meta = engine.read_checkpoint(path)
    if meta.get("framework") != cfg.framework:
        raise HvdtrainError(f"checkpoint {path} was written by {meta.get('framework')}")
    return Position(**{k: int(meta["position"][k]) for k in _FIELDS})


def _read_on_rank0(engine: Engine, path: Path | None, cfg: Config) -> dict[str, float]:
    if engine.rank != 0 or path is None:
        return {"found": 0.0, "failed": 0.0, **{k: 0.0 for k in _FIELDS}}
    try:
        position = read_position(engine, path, cfg)
    except HvdtrainError as exc:
        print(f"hvdtrain: error: {exc}", flush=True)
        return {"found": 0.0, "failed": 1.0, **{k: 0.0 for k in _FIELDS}}
    return {"found": 1.0, "failed": 0.0, **{k: float(getattr(position, k)) for k in _FIELDS}}


def restore(engine: Engine, path: Path | None, cfg: Config) -> Position | None:
    """Loads ``path`` on rank 0 and shares its position; None when there was nothing to resume.

    Every rank takes part in the same allreduce whatever happens on rank 0, so a checkpoint that
    does not fit the model stops all ranks with an error instead of leaving them waiting.
    """
    shared = engine.allreduce_sums(_read_on_rank0(engine, path, cfg))
    if shared["failed"]:
        raise HvdtrainError(f"cannot resume from {path or 'rank 0s checkpoint'}: it does not match "
                            "this run's framework or model (see the error printed above)")
    if not shared["found"]:
        return None
    return Position(**{k: int(shared[k]) for k in _FIELDS})


def trim_metrics(path: Path, step: int) -> None:
    """Drops records logged after ``step`` (between the checkpoint and a crash), which the resumed
    run logs again, so ``metrics.jsonl`` holds each step once."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if json.loads(line).get("step", 0) <= step]
    path.write_text("".join(kept))
