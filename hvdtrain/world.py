"""What of a run depends on the world size it trains at, apart from the config it was given."""

from __future__ import annotations

from dataclasses import dataclass

from hvdtrain.config import Config
from hvdtrain.pipeline.schedules import microbatch_count


@dataclass(frozen=True)
class World:
    """The world a loop trains in: ``size`` ranks, each accumulating ``accumulation``
    micro-batches per step, with ``lr`` the one-rank learning rate the schedule starts from.

    A run at a fixed size has one, made from its config (:meth:`of`); elastic mode makes one per
    world size (:func:`hvdtrain.elastic.world_at`) and keeps the config as the user wrote it.
    """

    size: int
    accumulation: int
    lr: float
    stages: int = 1
    """Pipeline stages: ``size`` then counts pipeline copies (the data-parallel width: what the
    sampler shards over and the learning rate scales with), each of ``stages`` ranks, and
    ``accumulation`` is the pipeline's micro-batches."""

    @classmethod
    def of(cls, cfg: Config, size: int) -> World:
        """The world of ``cfg`` as configured, at ``size`` ranks."""
        pipe = cfg.pipeline
        if pipe.stages > 1:
            return cls(size // pipe.stages, microbatch_count(pipe.stages, pipe.microbatches,
                                                             pipe.virtual_stages),
                       cfg.optim.lr, pipe.stages)
        return cls(size, cfg.train.backward_passes_per_step, cfg.optim.lr)

    def copy_of(self, rank: int) -> int:
        """The data-parallel copy that ``rank`` belongs to (its own index without stages; the
        layout of :class:`hvdtrain.pipeline.layout.Layout` with them)."""
        return rank // self.stages
