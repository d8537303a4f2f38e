"""The dataset contract: a dataset gives two map-style sources, each a length and a way to load a
batch of samples by index. A source need not fit in memory: each rank loads only the indices the
sampler gives it, in the loader's worker processes or threads.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from hvdtrain.errors import HvdtrainError


@dataclass(frozen=True)
class DatasetSpec:
    """What a model needs to know about its data."""

    input_shape: tuple[int, ...]
    num_classes: int


@dataclass(frozen=True)
class Draw:
    """What augmentation draws its randomness from, besides the sample's index: the run's seed and
    the epoch. A resumed or resized run therefore draws the same for every sample."""

    seed: int
    epoch: int


@dataclass(frozen=True)
class Batch:
    """Samples loaded by index: inputs ``x`` (float32, the batch first) and int64 labels ``y``.

    ``skipped`` names the unreadable files that were replaced (``skip_corrupt``)."""

    x: np.ndarray
    y: np.ndarray
    skipped: tuple[str, ...] = ()


class Source(abc.ABC):
    """One split, map-style: ``len(source)`` samples, loaded a batch at a time by index.

    ``load`` runs in the loaders' worker processes (PyTorch) or threads (``tf.data``), so it must
    not depend on state the training process changes after the loader started. It raises
    :class:`~hvdtrain.errors.HvdtrainError` naming the sample it could not read.
    """

    in_memory: ClassVar[bool] = False
    """True when loading is a memory gather: the engine then indexes it on the training thread,
    since handing a batch between processes would cost more than gathering it."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """The number of samples."""

    @abc.abstractmethod
    def load(self, indices: np.ndarray, draw: Draw | None = None) -> Batch:
        """The samples at ``indices``, in that order, augmented with ``draw`` (None: as stored,
        for evaluation). An empty ``indices`` gives an empty batch of the right shape."""


@dataclass(frozen=True)
class Split(Source):
    """One split of a dataset as NumPy arrays in memory: inputs ``x`` (float32), integer labels ``y``."""

    in_memory: ClassVar[bool] = True
    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise HvdtrainError(f"dataset split has {len(self.x)} inputs but {len(self.y)} labels")

    def __len__(self) -> int:
        return len(self.y)

    def load(self, indices: np.ndarray, draw: Draw | None = None) -> Batch:
        return Batch(self.x[indices], self.y[indices])


class Dataset(abc.ABC):
    """A dataset plug-in: a training and a test :class:`Source`, the same on every rank.

    Subclass it and name it in the config as ``data.name: package.module:MyDataset``; the
    ``data.options`` mapping is passed to the constructor as keyword arguments. Problems a run
    would meet later (an empty class, shapes that differ between splits) are raised here, before
    training starts.
    """

    @abc.abstractmethod
    def spec(self) -> DatasetSpec:
        """Input shape (without the batch dimension) and the number of classes."""

    @abc.abstractmethod
    def train(self) -> Source:
        """The training split."""

    @abc.abstractmethod
    def test(self) -> Source:
        """The evaluation split."""


class BuiltDataset(Dataset):
    """A dataset whose constructor builds its spec and both splits once, into ``_spec``,
    ``_train`` and ``_test``; the accessors hand them out."""

    _spec: DatasetSpec
    _train: Source
    _test: Source

    def spec(self) -> DatasetSpec:
        return self._spec

    def train(self) -> Source:
        return self._train

    def test(self) -> Source:
        return self._test


def check_label_range(y: np.ndarray, num_classes: int, where: str) -> None:
    """Raises when labels fall outside ``[0, num_classes)``: the loss would fail mid-run."""
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise HvdtrainError(f"{where}: labels must lie in [0, {num_classes}); "
                            f"found {int(y.min())} to {int(y.max())}")
