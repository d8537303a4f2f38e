"""Which rank holds which stage of which pipeline copy, and the groups of ranks that talk.

``size`` ranks form ``copies = size / stages`` copies of one pipeline. Rank ``r`` is stage
``r % stages`` of copy ``r // stages``: a copy's ranks are consecutive (stage-to-stage tensors
travel every micro-batch, so a pipeline stays on as few hosts as the launcher's slots allow), and
rank 0 is stage 0 of copy 0, the rank that writes. Two kinds of groups follow:

- a copy's ranks (:meth:`Layout.pipeline_ranks`) pass activations and their gradients between
  neighbouring stages (torch process groups, or Horovod process sets of two ranks);
- a stage's ranks across the copies (:meth:`Layout.stage_ranks`) hold the same layers and average
  their gradients once per step (a Horovod process set): the data-parallel group of that stage.

With one stage there is one group of each kind that matters: every rank is a copy, as today.
"""

from __future__ import annotations

from dataclasses import dataclass

from hvdtrain.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """``size`` ranks arranged as ``size / stages`` pipeline copies of ``stages`` ranks each."""

    size: int
    stages: int

    def __post_init__(self) -> None:
        if self.stages < 1 or self.size < 1:
            raise ConfigError(f"pipeline.stages={self.stages} at world size {self.size}: both "
                              "must be at least 1")
        if self.size % self.stages:
            raise ConfigError(f"pipeline.stages={self.stages} does not divide the world size "
                              f"{self.size}: launch a multiple of {self.stages} ranks (stages x "
                              "data-parallel copies)")

    @property
    def copies(self) -> int:
        """Data-parallel copies of the pipeline."""
        return self.size // self.stages

    def describe(self) -> str:
        """``"2 stages x 2 copies"``: the run summary's ``pipeline`` entry."""
        return f"{self.stages} stages x {self.copies} copies"

    def stage_of(self, rank: int) -> int:
        """The stage that ``rank`` holds."""
        return self._checked(rank) % self.stages

    def copy_of(self, rank: int) -> int:
        """The pipeline copy that ``rank`` belongs to (its data-parallel replica index)."""
        return self._checked(rank) // self.stages

    def rank_of(self, stage: int, copy: int) -> int:
        """The rank that holds ``stage`` of ``copy``."""
        if not (0 <= stage < self.stages and 0 <= copy < self.copies):
            raise ValueError(f"no stage {stage} of copy {copy} in {self}")
        return copy * self.stages + stage

    def pipeline_ranks(self, copy: int) -> list[int]:
        """The ranks of pipeline ``copy``, stage 0 first."""
        return [self.rank_of(s, copy) for s in range(self.stages)]

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks holding ``stage``, copy 0 first: that stage's data-parallel group."""
        return [self.rank_of(stage, c) for c in range(self.copies)]

    def pipelines(self) -> list[list[int]]:
        """Every copy's ranks, copy 0 first."""
        return [self.pipeline_ranks(c) for c in range(self.copies)]

    def stage_groups(self) -> list[list[int]]:
        """Every stage's data-parallel group, stage 0 first."""
        return [self.stage_ranks(s) for s in range(self.stages)]

    def is_first(self, rank: int) -> bool:
        """Whether ``rank`` holds the first stage (it reads the inputs)."""
        return self.stage_of(rank) == 0

    def is_last(self, rank: int) -> bool:
        """Whether ``rank`` holds the last stage (it reads the targets, computes loss and
        metrics)."""
        return self.stage_of(rank) == self.stages - 1

    def loads_data(self, rank: int) -> bool:
        """Whether ``rank`` reads training data: only the first and last stages do."""
        return self.is_first(rank) or self.is_last(rank)

    def _checked(self, rank: int) -> int:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside a world of {self.size}")
        return rank
