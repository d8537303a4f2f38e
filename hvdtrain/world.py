"""What of a run depends on the world size it trains at, apart from the config it was given."""

from __future__ import annotations

from dataclasses import dataclass

from hvdtrain.config import Config


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

    @classmethod
    def of(cls, cfg: Config, size: int) -> World:
        """The world of ``cfg`` as configured, at ``size`` ranks."""
        return cls(size, cfg.train.backward_passes_per_step, cfg.optim.lr)
