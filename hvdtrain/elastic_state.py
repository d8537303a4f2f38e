"""The elastic training state on Horovod's ``State`` (see :mod:`hvdtrain.elastic` for the policy).

Apart from :mod:`hvdtrain.elastic`, so that the policy can be imported (and unit-tested) without Horovod.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

from horovod.common.elastic import State

from hvdtrain.config import Config
from hvdtrain.elastic import ElasticBackend, IndexRecord
from hvdtrain.engine import Engine
from hvdtrain.loop import Position


class TrainingState(State):
    """The elastic state: the engine's checkpoint in memory, the position and counters.

    ``save`` writes the engine's checkpoint into a buffer, ``restore`` reads the last one back, and
    ``sync`` broadcasts rank 0's committed state to every rank (new workers included).
    """

    def __init__(self, engine: Engine, backend: ElasticBackend, cfg: Config, position: Position,
                 error: str = "") -> None:
        super().__init__(bcast_object=backend.broadcast_object, get_rank=backend.rank)
        self.engine, self.backend, self.seed = engine, backend, cfg.seed
        self.position = position
        self.error = error
        """A problem found by rank 0 before training (shared by ``sync`` so that all ranks stop)."""
        self.reference_size = engine.size
        self.record = IndexRecord(cfg.elastic.record_indices)
        self.commits = self.resets = 0
        self.failed_at: int | None = None
        self._saved: dict[str, Any] = {}
        self.save()

    def save(self) -> None:
        buffer = io.BytesIO()
        self.engine.write_checkpoint(buffer, {})
        self._saved = {"engine": buffer.getvalue(), "position": dataclasses.asdict(self.position),
                       "error": self.error, "reference_size": self.reference_size,
                       "record": self.record.snapshot(), "commits": self.commits}

    def restore(self) -> None:
        saved = self._saved
        self.engine.read_checkpoint(io.BytesIO(saved["engine"]))  # type: ignore[arg-type]
        self.position = Position(**saved["position"])
        self.error, self.reference_size = saved["error"], saved["reference_size"]
        self.record.reset_to(saved["record"])
        self.commits = saved["commits"]

    def sync(self) -> None:
        self._saved = self._bcast_object(self._saved)
        self.restore()
        self.backend.refresh(self.engine)
        # Every rank now holds rank 0's model and optimizer; this also hands each rank its share
        # of the compression state (error-feedback residuals) that the checkpoint carries.
        self.engine.broadcast_state()
        if self.engine.rank != 0:
            self.backend.fork_rng(self.seed, self.engine.rank, self.position.step)

    def reset(self) -> None:
        self.resets += 1

    def commit_at(self, position: Position) -> None:
        """Commits the state as it stands after ``position`` (may raise Horovod's interrupts)."""
        self.position = dataclasses.replace(position)
        self.record.gather(self.backend.allgather_object)
        self.engine.gather_checkpoint_state()  # every rank's compression state, into the save
        self.commits += 1
        self.commit()
