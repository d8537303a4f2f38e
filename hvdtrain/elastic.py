"""Elastic training: the run continues when workers die or join (``elastic.enabled``).

A mode of the run driver (:mod:`hvdtrain.driver`). This module is the policy, framework-free and
importable without Horovod; :mod:`hvdtrain.elastic_mode` runs it on Horovod's elastic ``State``,
which takes the engine's collectives as callables.

- The state is the engine's own checkpoint (model, optimizer, random-number states, compression
  state) written into memory, plus the run's :class:`~hvdtrain.loop.Position` and counters. It is
  committed every ``elastic.commit_every`` steps at a step boundary; a worker that dies costs the
  others at most that many steps, which they redo from the last commit.
- After a reset the loop is rebuilt at the new world size from the committed position: the samples
  of the epoch not yet trained on are re-sharded over the new ranks (:class:`ShardedSampler` with
  ``start``), so every sample is used exactly once per epoch. Horovod's own ``ElasticSampler`` is
  not used: it loses indices when workers leave (horovod issue 3143).
- The learning rate follows the new world size (``on_resize: scale_lr``), or accumulation keeps the
  starting global batch and learning rate (``keep_global_batch``).
- Nothing runs a collective before the function given to ``hvd.elastic.run``: a worker that joins
  would otherwise meet the others in the wrong collective.
- With ``shard.stage`` 1-3 each rank holds only its shard of the state, which dies with it: a
  commit also writes every rank's shards to disk (:class:`CommitParts`), and after a reset every
  rank reads its new shards from them, as a checkpoint of shards resumes at any number of ranks.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.checkpoint import atomic_write
from hvdtrain.config import Config
from hvdtrain.data.sampler import StepIndices
from hvdtrain.errors import EnvironmentFailure
from hvdtrain.loop import Callback, Position
from hvdtrain.world import World


def world_at(cfg: Config, reference_size: int, size: int) -> World:
    """The world the loop trains in at ``size`` ranks, for a run that started at ``reference_size``.

    ``scale_lr`` changes nothing but the size: the learning rate already follows the world size.
    With ``keep_global_batch`` the ranks accumulate ``reference_size x accumulation / size``
    micro-batches, and the one-rank rate is rescaled so that the scaled rate stays the starting one.
    """
    world = World.of(cfg, size)
    if cfg.elastic.on_resize != "keep_global_batch" or size == reference_size:
        return world
    micro = reference_size * cfg.train.backward_passes_per_step
    accumulation = max(1, round(micro / size))
    if accumulation * size != micro:
        warnings.warn(f"elastic.on_resize=keep_global_batch: {micro} micro-batches per step cannot be "
                      f"split evenly over {size} ranks; using {accumulation} per rank", stacklevel=2)
    lr = cfg.optim.lr * reference_size / size if cfg.optim.scale_lr else cfg.optim.lr
    return World(size, accumulation, lr)


class IndexRecord:
    """The sample indices trained on per epoch, counting committed steps only.

    Each rank keeps its own indices since the last commit; a commit gathers them into the record,
    which is part of the committed state, so steps that a reset rolls back drop out of it again.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.committed: dict[int, list[np.ndarray]] = {}
        self.pending: dict[int, list[np.ndarray]] = {}

    def add(self, epoch: int, indices: StepIndices) -> None:
        """Notes this rank's indices of one step."""
        if self.enabled:
            self.pending.setdefault(epoch, []).extend(m for m in indices.micro if len(m))

    def gather(self, allgather_object: Callable[[Any], list[Any]]) -> None:
        """Moves every rank's pending indices into the record (a collective when enabled)."""
        if not self.enabled:
            return
        for pending in allgather_object(self.pending):
            for epoch, arrays in pending.items():
                self.committed.setdefault(epoch, []).extend(arrays)
        self.pending = {}

    def snapshot(self) -> dict[int, list[np.ndarray]]:
        """A copy of the record to keep with a commit."""
        return {epoch: list(arrays) for epoch, arrays in self.committed.items()}

    def reset_to(self, committed: dict[int, list[np.ndarray]]) -> None:
        """Returns to a committed record, dropping what was trained since."""
        self.committed, self.pending = {e: list(a) for e, a in committed.items()}, {}

    def write(self, directory: Path) -> None:
        """Writes ``epoch-<e>.npy`` per epoch: its indices in the order they were gathered."""
        directory.mkdir(parents=True, exist_ok=True)
        for epoch, arrays in self.committed.items():
            np.save(directory / f"epoch-{epoch:04d}.npy",
                    np.concatenate(arrays) if arrays else np.zeros(0, np.int64))


class Committer(Callback):
    """Notes each step's indices and commits the state every ``commit_every`` steps, each commit
    after ``before_commit`` (the session writing out its metrics records, which a new rank 0 keeps
    up to the commit)."""

    def __init__(self, state: Any, commit_every: int, before_commit: Callable[[], None]) -> None:
        self.state, self.commit_every, self.before_commit = state, commit_every, before_commit

    def on_step_end(self, epoch: int, indices: StepIndices) -> None:
        self.state.record.add(epoch, indices)

    def on_boundary(self, position: Position) -> None:
        if position.step - self.state.position.step >= self.commit_every:
            self.before_commit()
            self.state.commit_at(position)


def entry_event(state: Any, accumulation: int) -> dict[str, Any]:
    """What happened before this entry into the training function: the start or a reset."""
    position, size = state.position, state.engine.size
    event: dict[str, Any] = {"event": "reset" if state.resets else "start", "world_size": size,
                             "step": position.step, "epoch": position.epoch,
                             "in_epoch": position.in_epoch,
                             "accumulation": accumulation}
    if state.failed_at is not None:
        event["lost_steps"] = state.failed_at - position.step
    return event


class CommitParts:
    """The shards of a sharded run's elastic commits (``shard.stage`` 1-3), in ``directory``.

    A rank's shard of the parameters and optimizer state lives in its memory only, so a commit
    kept in memory (as the ring's is) would die with the rank. At each commit every rank writes
    its own shards to ``commit-<n>.rank-<r>.part`` (the safetensors part of a checkpoint of
    shards, :mod:`hvdtrain.shard_files`), all at once and each atomically; the entries of every
    part, gathered, go into the committed state (no manifest: a rank that dies after the gather
    leaves every part on disk). After a reset each rank reads its shard of the new world from
    the parts of the commit rank 0 holds. The last two commits are kept: a rank may hold either
    when another dies mid-commit.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def write(self, engine: Any, number: int) -> list[dict[str, Any]]:
        """Writes this rank's part of commit ``number`` and returns every rank's entry (file
        name, shard, of), in rank order; a collective. Raises on every rank when a write
        failed."""
        part = engine.shard_part()
        entry: dict[str, Any] | None = None
        if part is not None:
            label, fields, write = part
            path = self.directory / f"commit-{number:08d}.{label}.part"
            try:
                atomic_write(path, write)
                entry = {"file": path.name, **fields}
            except OSError as exc:
                entry = {"error": f"cannot write the elastic commit's part {path}: {exc}"}
        # In a list: Horovod names the collective after the object's type (None or dict).
        entries = [got[0] for got in engine.collectives.allgather_object([entry])]
        failures = [e["error"] for e in entries if e is not None and "error" in e]
        if failures:
            raise EnvironmentFailure(failures[0])
        return [e for e in entries if e is not None]

    def source(self) -> Path:
        """The path a reader of parts takes the directory of (``Engine.restore_from``)."""
        return self.directory / "commit"

    def prune(self, keep_from: int) -> None:
        """Removes the parts (and temporary files) of the commits before ``keep_from``."""
        for path in [*self.directory.glob("commit-*.part"), *self.directory.glob(".commit-*")]:
            number = path.name.lstrip(".").split(".", 1)[0].removeprefix("commit-")
            if number.isdigit() and int(number) < keep_from:
                path.unlink(missing_ok=True)

    def remove(self) -> None:
        """Removes every commit's parts (the run ended: nothing resumes from them)."""
        shutil.rmtree(self.directory, ignore_errors=True)
