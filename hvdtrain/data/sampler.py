"""The sharding sampler: one global batch per step, every sample once per epoch.

Sharding is by global batch: step ``s`` of an epoch takes the next ``batch x world x accumulation``
samples of the epoch's permutation, and rank ``r`` takes every ``world``-th of each micro-batch's
slice, starting at ``r``. Hence every sample is seen exactly once per epoch across the ranks, the
global batches do not depend on the world size's split of them, and the position in an epoch is one
number (samples consumed) that a resumed or resized job can continue from.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from hvdtrain.errors import HvdtrainError


@dataclass(frozen=True)
class StepIndices:
    """One optimizer step for one rank: sample indices per micro-batch, and the step's global size.

    ``plan`` and ``number`` place the step in its epoch's :class:`EpochPlan`, so that a loader can
    prefetch the steps that follow it.
    """

    micro: list[np.ndarray]
    global_count: int
    plan: EpochPlan | None = field(default=None, repr=False, compare=False)
    number: int = 0


class EpochPlan:
    """One rank's steps of one epoch from a sample position: the order a loader fetches in.

    Iterating it gives the :class:`StepIndices`; each knows its plan and its place in it.
    """

    def __init__(self, epoch: int, steps: list[tuple[list[np.ndarray], int]]) -> None:
        self.epoch = epoch
        self.steps = [StepIndices(micro, count, self, number)
                      for number, (micro, count) in enumerate(steps)]

    def __iter__(self) -> Iterator[StepIndices]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def micro_batches(self, first: int = 0) -> list[np.ndarray]:
        """The micro-batches of steps ``first`` onwards, in training order."""
        return [micro for step in self.steps[first:] for micro in step.micro]


class ShardedSampler:
    """Shards each epoch's permutation over the ranks, one global batch at a time.

    Like ``DistributedSampler.set_epoch``, the permutation depends only on ``(seed, epoch)``, so
    every rank (and both frameworks) compute the same one without communicating. A step's last
    micro-batches may be short or, on some ranks, empty; the engines weight each rank's loss by its
    share of the step's samples so the gradient is still the mean over the global batch.
    """

    def __init__(self, num_samples: int, batch_size: int, *, accumulation: int = 1,
                 seed: int = 0, shuffle: bool = True) -> None:
        if num_samples < 1:
            raise HvdtrainError("the training split is empty")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.accumulation = accumulation
        self.seed = seed
        self.shuffle = shuffle

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the samples in ``epoch``."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def step_samples(self, world_size: int) -> int:
        """Samples per optimizer step across all ranks."""
        return self.batch_size * world_size * self.accumulation

    def steps_in_epoch(self, world_size: int, start: int = 0) -> int:
        """Optimizer steps left in an epoch from sample position ``start``."""
        return math.ceil((self.num_samples - start) / self.step_samples(world_size))

    def steps(self, epoch: int, rank: int, world_size: int, start: int = 0) -> EpochPlan:
        """This rank's steps of ``epoch`` from sample position ``start`` (the samples before it)."""
        order = self.permutation(epoch)[start:]
        per_step, per_micro = self.step_samples(world_size), self.batch_size * world_size
        steps = []
        for begin in range(0, len(order), per_step):
            chunk = order[begin:begin + per_step]
            micro = [chunk[m:m + per_micro][rank::world_size]
                     for m in range(0, per_step, per_micro)]
            steps.append((micro, len(chunk)))
        return EpochPlan(epoch, steps)


def eval_shards(num_samples: int, rank: int, world_size: int, batch_size: int
                ) -> Iterator[np.ndarray]:
    """This rank's evaluation batches: every ``world_size``-th sample, in order, in batches.

    Every rank gets as many batches as the rank with the most samples, its last one short or
    empty where it has fewer: a sharded model (``shard.stage=3``) gathers its parameters in each
    batch's forward, a collective of every rank, so a rank with one batch fewer would leave the
    others waiting. A rank with no samples gets one empty batch, so that every rank reports the
    same metric names to the allreduce that follows.
    """
    mine = np.arange(rank, num_samples, world_size)
    most = max(-(-num_samples // world_size), 1)  # the largest rank's share
    for begin in range(0, most, batch_size):
        yield mine[begin:begin + batch_size]
