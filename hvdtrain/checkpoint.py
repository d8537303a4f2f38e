"""Checkpoint policy and atomic file I/O (framework-free; the engine serialises its own state).

A checkpoint is written to a temporary file in the same directory, flushed and fsynced, then renamed
over its final name, so a crash leaves either the old set of checkpoints or the new one, never a
half-written file under a checkpoint's name.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import IO, Any, Callable

from hvdtrain.config import CheckpointConfig
from hvdtrain.engine import Engine

SUFFIX = ".ckpt"


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Writes ``path`` through ``write(fileobj)`` so that it appears complete or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fileobj:
            write(fileobj)
            fileobj.flush()
            os.fsync(fileobj.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # makes the rename itself durable
    finally:
        os.close(dir_fd)


class CheckpointManager:
    """Decides when to checkpoint, writes on rank 0 only, and keeps the newest ``keep`` files."""

    def __init__(self, cfg: CheckpointConfig, directory: Path, *, writer: bool) -> None:
        self.cfg = cfg
        self.directory = directory
        self.writer = writer

    def due(self, step: int) -> bool:
        """Whether the periodic policy asks for a checkpoint after optimizer step ``step``."""
        every = self.cfg.every_steps
        return self.cfg.enabled and every > 0 and step % every == 0

    def save(self, engine: Engine, step: int, meta: dict[str, Any]) -> Path | None:
        """Called on every rank; rank 0 writes ``step-<step>.ckpt``. Returns the path written."""
        if not (self.cfg.enabled and self.writer):
            return None
        path = self.directory / f"step-{step:08d}{SUFFIX}"
        atomic_write(path, lambda f: engine.write_checkpoint(f, {**meta, "step": step}))
        self._prune()
        return path

    def checkpoints(self) -> list[Path]:
        """Finished checkpoints, oldest first."""
        return sorted(self.directory.glob(f"step-*{SUFFIX}"))

    def _prune(self) -> None:
        for old in self.checkpoints()[:-self.cfg.keep]:
            old.unlink(missing_ok=True)
