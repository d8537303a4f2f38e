"""Elastic mode of the run driver on Horovod's elastic ``State``; the policy is :mod:`hvdtrain.elastic`.

Imported only when ``elastic.enabled``, since it loads Horovod's elastic machinery.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from horovod.common.elastic import State

from hvdtrain.config import Config
from hvdtrain.elastic import Committer, IndexRecord, entry_event, world_at
from hvdtrain.engine import Engine
from hvdtrain.loop import Position
from hvdtrain.rundir import RunDir
from hvdtrain.session import Session, Start
from hvdtrain.world import World


class TrainingState(State):
    """The elastic state: the engine's state in memory, the position and counters.

    ``save`` serialises the engine's state, ``restore`` reads the last one back, and ``sync``
    broadcasts rank 0's committed state to every rank (new workers included).
    """

    def __init__(self, engine: Engine, cfg: Config, start: Start) -> None:
        collectives = engine.collectives
        super().__init__(bcast_object=collectives.broadcast_object, get_rank=collectives.rank)
        self.engine, self.cfg = engine, cfg
        self.position, self.error = start.position, start.error
        self.reference_size = engine.size
        self.world = World.of(cfg, engine.size)
        """The world the loop trains in at the current world size (:func:`world_at`)."""
        self.record = IndexRecord(cfg.elastic.record_indices)
        self.commits = self.resets = 0
        self.failed_at: int | None = None
        self._saved: dict[str, Any] = {}
        self.save()

    def save(self) -> None:
        self._saved = {"engine": self.engine.state_bytes({}),
                       "position": dataclasses.asdict(self.position),
                       "error": self.error, "reference_size": self.reference_size,
                       "record": self.record.snapshot(), "commits": self.commits}

    def restore(self) -> None:
        saved = self._saved
        self.engine.load_state(saved["engine"], "the elastic state")
        self.position = Position(**saved["position"])
        self.error, self.reference_size = saved["error"], saved["reference_size"]
        self.record.reset_to(saved["record"])
        self.commits = saved["commits"]

    def sync(self) -> None:
        self._saved = self._bcast_object(self._saved)
        self.restore()
        self.follow_world()
        # Every rank now holds rank 0's model and optimizer; this also hands each rank its share
        # of the compression state (error-feedback residuals) that the state carries.
        self.engine.broadcast_state()
        if self.engine.rank != 0:
            self.engine.fork_rng(self.cfg.seed, self.position.step)

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
        self.engine.gather_state()  # every rank's compression state, into the save
        self.commits += 1
        self.commit()


class ElasticMode:
    """The driver's elastic mode: the session runs inside ``hvd.elastic.run``, again after every
    reset, from the last commit at the new world size."""

    def __init__(self, cfg: Config, session: Session, start: Start) -> None:
        self.cfg, self.session = cfg, session
        self.state = TrainingState(session.engine, cfg, start)

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
                                       "start_world_size": state.reference_size}}

    def finish(self, run_dir: RunDir) -> None:
        """Writes the record of the sample indices trained on (rank 0)."""
        self.state.record.write(run_dir.indices)
