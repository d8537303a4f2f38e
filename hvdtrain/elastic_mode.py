"""Elastic mode of the run driver on Horovod's elastic ``State``; the policy is :mod:`hvdtrain.elastic`.

Imported only when ``elastic.enabled``, since it loads Horovod's elastic machinery.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from horovod.common.elastic import State

from hvdtrain.config import Config
from hvdtrain.elastic import CommitParts, Committer, IndexRecord, entry_event, world_at
from hvdtrain.engine import Engine
from hvdtrain.errors import HvdtrainError
from hvdtrain.loop import Position
from hvdtrain.rundir import RunDir
from hvdtrain.session import Session, Start
from hvdtrain.world import World


class TrainingState(State):
    """The elastic state: the engine's state in memory, the position and counters.

    ``save`` serialises the engine's state, ``restore`` reads the last one back, and ``sync``
    broadcasts rank 0's committed state to every rank (new workers included). With
    ``shard.stage`` 1-3 a commit also writes every rank's shards to ``parts``
    (:class:`CommitParts`), and ``sync`` rebuilds the model and optimizer for the new world and
    reads each rank's new shards from the commit's parts.
    """

    def __init__(self, engine: Engine, cfg: Config, start: Start,
                 parts: CommitParts | None = None) -> None:
        if cfg.shard.stage and parts is None:
            raise HvdtrainError(f"elastic.enabled=true with shard.stage={cfg.shard.stage} in "
                                "your own loop: re-sharding makes the model and optimizer that "
                                "your loop holds again; use hvdtrain train or shard.stage=0")
        collectives = engine.collectives
        super().__init__(bcast_object=collectives.broadcast_object, get_rank=collectives.rank)
        self.engine, self.cfg, self.parts = engine, cfg, parts  # sharded: its commits' parts
        self.position, self.error = start.position, start.error
        self.reference_size = engine.size
        self.world = World.of(cfg, engine.size)
        """The world the loop trains in at the current world size (:func:`world_at`)."""
        self.record = IndexRecord(cfg.elastic.record_indices)
        self.commits = self.resets = 0
        self.failed_at: int | None = None
        self.sharded = cfg.shard.stage >= 1
        self.cut_at = (engine.rank, engine.size)  # the world the engine's shards are cut for
        self.commit_s = 0.0  # seconds this rank spent committing (writing its shards included)
        self._saved: dict[str, Any] = {}
        self.save()

    def save(self) -> None:
        began = time.perf_counter()
        engine, number, parts = self._engine_state()
        self._saved = {"engine": engine, "number": number, "parts": parts,
                       "position": dataclasses.asdict(self.position),
                       "error": self.error, "reference_size": self.reference_size,
                       "record": self.record.snapshot(), "commits": self.commits}
        if parts and self.parts is not None and self.engine.rank == 0:
            self.parts.prune(number - 1)  # a rank may hold the commit before when one dies now
        self.commit_s += time.perf_counter() - began

    def _engine_state(self) -> tuple[bytes | None, int, list[dict[str, Any]] | None]:
        """The engine's state to commit, the commit's number and its parts (sharded)."""
        if not self.sharded or self.parts is None:  # parts: refused above when sharded
            return self.engine.state_bytes({}), 0, None
        if not self._saved:  # before hvd.elastic.run: no collective; the first entry commits
            return None, 0, None
        number = self._saved["number"] + 1
        entries = self.parts.write(self.engine, number)  # also calls engine.shard_part()
        return self.engine.state_bytes({"parts": entries}), number, entries

    def restore(self) -> None:
        saved = self._saved
        if not self.sharded:  # sharded: sync() loads it, once the model is cut for the world
            self.engine.load_state(saved["engine"], "the elastic state")
        self.position = Position(**saved["position"])
        self.error, self.reference_size = saved["error"], saved["reference_size"]
        self.record.reset_to(saved["record"])
        self.commits = saved["commits"]

    def sync(self) -> None:
        self._saved = self._bcast_object(self._saved)
        self.restore()
        self.follow_world()
        if self.sharded:
            self._load_shards()
        # Every rank now holds rank 0's model and optimizer (sharded: each rank its new shards,
        # read from the commit's parts); this also hands each rank its share of the compression
        # state (error-feedback residuals) that the state carries.
        self.engine.broadcast_state()
        if self.engine.rank != 0:
            self.engine.fork_rng(self.cfg.seed, self.position.step)

    def _load_shards(self) -> None:
        """Sharded: the model and optimizer built again for the world Horovod runs at now, and
        the committed state loaded into them; ``broadcast_state`` then has every rank read its
        new shards from the commit's parts."""
        engine, saved = self.engine, self._saved
        world = (engine.rank, engine.size)
        if saved["engine"] is None:  # the start's state, before the first commit
            if world != self.cut_at:
                raise HvdtrainError(f"shard.stage={self.cfg.shard.stage}: a worker was lost "
                                    "before the first elastic commit; resubmit the job")
            return
        engine.reshard()
        assert self.parts is not None, "a sharded run's state has its commits' parts"
        engine.restore_from = self.parts.source()
        engine.load_state(saved["engine"], "the elastic commit")
        self.cut_at = world

    def follow_world(self) -> None:
        """Takes this rank's place and the world size Horovod runs at now into the engine and the
        loop's config. Called by :meth:`sync` and on every entry into the training function: a
        reset after hosts were only removed skips the sync (the survivors' states agree)."""
        collectives = self.engine.collectives
        size = collectives.size()
        self.world = world_at(self.cfg, self.reference_size, size)
        self.engine.resize(collectives.rank(), size, self.world.accumulation)

    def reset(self) -> None:
        self.resets += 1

    def commit_at(self, position: Position) -> None:
        """Commits the state as it stands after ``position`` (may raise Horovod's interrupts)."""
        self.position = dataclasses.replace(position)
        self.record.gather(self.engine.collectives.allgather_object)
        if not self.sharded:  # sharded: every rank writes its own shards instead
            self.engine.gather_state()  # every rank's compression state, into the save
        self.commits += 1
        self.commit()


class ElasticMode:
    """The driver's elastic mode: the session runs inside ``hvd.elastic.run``, again after every
    reset, from the last commit at the new world size."""

    def __init__(self, cfg: Config, session: Session, start: Start) -> None:
        self.cfg, self.session = cfg, session
        self.state = TrainingState(session.engine, cfg, start,
                                   CommitParts(session.run_dir.elastic_commits))

    def run(self, stop: Callable[[], bool], heartbeat: Callable[[], None]) -> dict[str, Any]:
        """Trains to the end through Horovod's elastic runner."""
        return self.session.engine.collectives.elastic_run(self._entry)(self.state, stop, heartbeat)

    def _entry(self, state: Any, stop: Callable[[], bool],
               heartbeat: Callable[[], None]) -> dict[str, Any]:
        """Trains from the committed state at the current world size to the end of the run."""
        session, engine = self.session, self.session.engine
        if state.error:
            raise state.error
        state.follow_world()
        if state.sharded:
            self._shards_ready(state)
        world = state.world
        if engine.rank == 0:
            session.run_dir.log_event(entry_event(state, world.accumulation))
            # Steps after the commit are trained again: their records would appear twice.
            session.run_dir.trim_metrics(state.position.step)
        committer = Committer(state, self.cfg.elastic.commit_every, session.write_metrics)
        try:
            summary = session.run(world, state.position, stop, heartbeat, extra=[committer])
            state.record.gather(engine.collectives.allgather_object)
        except Exception:
            if session.loop is not None:  # how far this rank got: the steps a reset loses
                state.failed_at = session.loop.pos.step
            raise
        return {**summary, "elastic": {"commits": state.commits, "resets": state.resets,
                                       "start_world_size": state.reference_size,
                                       "commit_s": round(state.commit_s, 3)}}

    @staticmethod
    def _shards_ready(state: TrainingState) -> None:
        """Sharded: shards cut for this world, and a commit in parts to come back to."""
        engine = state.engine
        if (engine.rank, engine.size) != state.cut_at:
            state.sync()  # hosts were only removed: Horovod skipped the sync, the shards moved
        if state._saved["engine"] is None:
            state.save()  # the start, in parts: the first reset returns to it

    def finish(self, run_dir: RunDir) -> None:
        """Writes the record of the sample indices trained on (rank 0) and removes the sharded
        commits' parts."""
        self.state.record.write(run_dir.indices)
        if self.state.parts is not None:
            self.state.parts.remove()
