"""Framework-free datasets and the sharding sampler.

Sharding is by global batch: step ``s`` of an epoch takes the next ``batch x world x accumulation``
samples of the epoch's permutation, and rank ``r`` takes every ``world``-th of each micro-batch's
slice, starting at ``r``. Hence every sample is seen exactly once per epoch across the ranks, the
global batches do not depend on the world size's split of them, and the position in an epoch is one
number (samples consumed) that a resumed or resized job can continue from.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from hvdtrain.errors import HvdtrainError


@dataclass(frozen=True)
class DatasetSpec:
    """What a model needs to know about its data."""

    input_shape: tuple[int, ...]
    num_classes: int


@dataclass(frozen=True)
class Split:
    """One split of a dataset as NumPy arrays: inputs ``x`` (float32) and integer labels ``y``."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise HvdtrainError(f"dataset split has {len(self.x)} inputs but {len(self.y)} labels")

    def __len__(self) -> int:
        return len(self.y)


class Dataset(abc.ABC):
    """A dataset plug-in: fixed train and test splits in memory, identical on every rank.

    Subclass it and name it in the config as ``data.name: package.module:MyDataset``; the
    ``data.options`` mapping is passed to the constructor as keyword arguments.
    """

    @abc.abstractmethod
    def spec(self) -> DatasetSpec:
        """Input shape (without the batch dimension) and the number of classes."""

    @abc.abstractmethod
    def train(self) -> Split:
        """The training split."""

    @abc.abstractmethod
    def test(self) -> Split:
        """The evaluation split."""


class DigitsDataset(Dataset):
    """scikit-learn's bundled 8x8 handwritten digits (1,797 images, no download).

    Pixels are scaled to [0, 1] and flattened to 64 features. The split is stratified and fixed
    (it does not depend on the run's seed), so runs with different seeds are comparable.
    """

    def __init__(self, test_fraction: float = 0.2, split_seed: int = 0) -> None:
        if not 0.0 < test_fraction < 1.0:
            raise HvdtrainError(f"data.options.test_fraction={test_fraction!r}: must be in (0, 1)")
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x = (x / 16.0).astype(np.float32)
        xtr, xte, ytr, yte = train_test_split(x, y.astype(np.int64), test_size=test_fraction,
                                              random_state=split_seed, stratify=y)
        self._train, self._test = Split(xtr, ytr), Split(xte, yte)

    def spec(self) -> DatasetSpec:
        return DatasetSpec(input_shape=(64,), num_classes=10)

    def train(self) -> Split:
        return self._train

    def test(self) -> Split:
        return self._test


@dataclass(frozen=True)
class StepIndices:
    """One optimizer step for one rank: sample indices per micro-batch, and the step's global size."""

    micro: list[np.ndarray]
    global_count: int


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

    def steps(self, epoch: int, rank: int, world_size: int, start: int = 0) -> Iterator[StepIndices]:
        """This rank's steps of ``epoch``, from sample position ``start`` (samples already consumed)."""
        order = self.permutation(epoch)[start:]
        per_step, per_micro = self.step_samples(world_size), self.batch_size * world_size
        for begin in range(0, len(order), per_step):
            chunk = order[begin:begin + per_step]
            micro = [chunk[m:m + per_micro][rank::world_size]
                     for m in range(0, per_step, per_micro)]
            yield StepIndices(micro=micro, global_count=len(chunk))


def eval_shards(num_samples: int, rank: int, world_size: int, batch_size: int) -> Iterator[np.ndarray]:
    """This rank's evaluation batches: every ``world_size``-th sample, in order, in batches.

    A rank with no samples still gets one empty batch, so that every rank reports the same metric
    names to the allreduce that follows.
    """
    mine = np.arange(rank, num_samples, world_size)
    for begin in range(0, max(len(mine), 1), batch_size):
        yield mine[begin:begin + batch_size]
