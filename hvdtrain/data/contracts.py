"""The dataset contract: a dataset gives two map-style sources, each a length and a way to load a
batch of samples by index. A source need not fit in memory: each rank loads only the indices the
sampler gives it, in the loader's worker processes or threads.

A batch's inputs and targets are arrays of any dtype and shape, or trees of them (tuples, lists,
dicts; :mod:`hvdtrain.data.tree`), the batch dimension first; targets may be None. The loaders turn
every array into a tensor and hand the trees to the model adapter's ``loss_and_metrics`` as they
are. Classification is the short path: float32 inputs ``x``, one int64 label a sample ``y``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from hvdtrain.data import tree
from hvdtrain.errors import HvdtrainError


@dataclass(frozen=True)
class ArraySpec:
    """One array of a sample: its shape without the batch dimension and its NumPy dtype.

    A size of ``None`` varies from batch to batch (sequences a custom source pads to its batch's
    longest, say); a ``tf.function`` traces it as an unknown dimension."""

    shape: tuple[int | None, ...]
    """The sample's shape: ``()`` for one label, ``(T,)`` for ``T`` token ids."""
    dtype: str = "float32"
    """The NumPy dtype's name (anything ``numpy.dtype`` takes is normalised to it)."""

    def __post_init__(self) -> None:
        try:
            shape = tuple(None if d is None else int(d) for d in self.shape)
            dtype = np.dtype(self.dtype).name
        except TypeError as exc:
            raise HvdtrainError(f"ArraySpec(shape={self.shape!r}, dtype={self.dtype!r}): "
                                f"{exc}") from None
        if any(d is not None and d < 0 for d in shape):
            raise HvdtrainError(f"ArraySpec: negative size in shape {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype)

    @classmethod
    def of(cls, array: Any, batched: bool = True) -> ArraySpec:
        """The spec of ``array``'s samples: of each row when ``batched``, else of the whole."""
        shape = np.shape(array)
        return cls(shape[1:] if batched else shape, tree.dtype_name(array.dtype))

    def empty(self) -> np.ndarray:
        """A batch of no samples of this spec (a varying size is 0)."""
        return np.zeros((0, *(d or 0 for d in self.shape)), self.dtype)

    def mismatch(self, array: Any) -> str:
        """How a batch's ``array`` differs from this spec, or an empty string when it fits."""
        shape, dtype = tuple(np.shape(array)), tree.dtype_name(array.dtype)
        fits = len(shape) == len(self.shape) + 1 and all(
            want is None or want == got for want, got in zip(self.shape, shape[1:], strict=True))
        if dtype == self.dtype and fits:
            return ""
        return f"{dtype}{list(shape[1:])} a sample, the dataset's spec says {self}"

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


LABELS = ArraySpec((), "int64")
"""Classification's targets: one int64 class index a sample."""


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """What a model needs to know about its data: the structure, shapes and dtypes of a sample's
    inputs and targets, and the number of classes where there are classes.

    ``inputs`` and ``targets`` are trees (:mod:`hvdtrain.data.tree`) of :class:`ArraySpec`: one
    spec, or tuples, lists and dicts of them, as a batch holds arrays (the batch dimension first).
    Classification is the short path: ``DatasetSpec(input_shape=(64,), num_classes=10)`` means
    float32 inputs of that shape and one int64 label a sample. For a language model::

        DatasetSpec(inputs={"tokens": ArraySpec((128,), "int64"),
                            "mask": ArraySpec((128,), "bool")},
                    targets=ArraySpec((128,), "int64"))

    and ``targets=None`` for data without targets (the adapter's loss uses the inputs alone).
    :meth:`of` reads the spec off a :class:`Split` or a :class:`Batch`.
    """

    inputs: Any = None
    """The inputs' tree of :class:`ArraySpec`; from ``input_shape`` (float32) when not given."""
    targets: Any = None
    """The targets' tree of :class:`ArraySpec`, or None for none; one int64 label a sample
    (:data:`LABELS`) when not given and ``num_classes`` is."""
    num_classes: int | None = None
    """The number of classes of a classification dataset (labels in ``[0, num_classes)``); None
    where the targets are not classes. Built-in models ``mlp`` and ``resnet18`` need it."""
    input_shape: tuple[int, ...] | None = None
    """The shape of a sample's one input array: given for the classification short path, or read
    off ``inputs`` when that is one :class:`ArraySpec`; None for inputs of several arrays."""

    def __post_init__(self) -> None:
        inputs = self.inputs
        if inputs is None and self.input_shape is not None:
            inputs = ArraySpec(tuple(self.input_shape), "float32")
        shape = inputs.shape if isinstance(inputs, ArraySpec) else None
        if self.input_shape is not None and tuple(self.input_shape) != shape:
            raise HvdtrainError(f"DatasetSpec.input_shape={self.input_shape!r} does not match "
                                f"inputs={tree.describe(inputs)}")
        targets = LABELS if self.targets is None and self.num_classes is not None else self.targets
        _check_specs(inputs, "inputs", may_be_none=False)
        _check_specs(targets, "targets", may_be_none=True)
        if self.num_classes is not None and (isinstance(self.num_classes, bool)
                                             or not isinstance(self.num_classes, int)
                                             or self.num_classes < 1):
            raise HvdtrainError(f"DatasetSpec.num_classes={self.num_classes!r}: expected a "
                                f"positive integer or None")
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "input_shape", shape)

    @classmethod
    def of(cls, batch: Split | Batch, num_classes: int | None = None) -> DatasetSpec:
        """The spec of the samples of ``batch`` (a :class:`Split` or a :class:`Batch`)."""
        def spec(array: Any) -> ArraySpec:
            return ArraySpec.of(array)
        return cls(inputs=tree.map_tree(spec, batch.x), targets=tree.map_tree(spec, batch.y),
                   num_classes=num_classes)

    def empty(self) -> Batch:
        """A batch of no samples: arrays of this spec's structure, shapes and dtypes."""
        def empty(spec: ArraySpec) -> np.ndarray:
            return spec.empty()
        return Batch(tree.map_tree(empty, self.inputs), tree.map_tree(empty, self.targets))

    def check(self, batch: Batch, size: int, where: str) -> None:
        """Raises :class:`~hvdtrain.errors.HvdtrainError` naming the first array of ``batch`` that
        is not of this spec's structure, dtype and shape, or whose batch size is not ``size``."""
        for name, specs, arrays in (("inputs", self.inputs, batch.x),
                                    ("targets", self.targets, batch.y)):
            tree.map_tree(lambda *_: None, specs, arrays, where=f"{where}: {name}")  # the structure
            leaves = zip(tree.leaves_with_paths(specs), tree.leaves(arrays), strict=True)
            for (path, spec), array in leaves:
                rows = np.shape(array)[0] if np.ndim(array) else None
                problem = (spec.mismatch(array)
                           or ("" if rows == size else f"{rows} samples, not {size}"))
                if problem:
                    raise HvdtrainError(f"{where}: {name}{tree.path_name(path)} has {problem}")


def _check_specs(specs: Any, field: str, may_be_none: bool) -> None:
    """Raises unless ``specs`` is a tree of :class:`ArraySpec` with at least one (None as a whole
    where ``may_be_none``: no targets)."""
    if specs is None and may_be_none:
        return
    found = list(tree.leaves_with_paths(specs))
    for path, leaf in found:
        if not isinstance(leaf, ArraySpec):
            raise HvdtrainError(f"DatasetSpec.{field}{tree.path_name(path)}: expected an "
                                f"ArraySpec(shape, dtype), got {leaf!r}")
    if not found or any(node is None for node in _nodes(specs)):
        what = ("None only as the whole targets (no targets)" if may_be_none
                else "give inputs or input_shape")
        raise HvdtrainError(f"DatasetSpec.{field}={tree.describe(specs)}: expected an ArraySpec, "
                            f"or a tuple, list or dict of them; {what}")


def _nodes(specs: Any) -> list[Any]:
    """Every node and leaf of a tree, the root first."""
    children = [] if not tree.is_node(specs) or specs is None else (
        specs.values() if isinstance(specs, dict) else specs)
    return [specs, *(node for child in children for node in _nodes(child))]


@dataclass(frozen=True)
class Draw:
    """What augmentation draws its randomness from, besides the sample's index: the run's seed and
    the epoch. A resumed or resized run therefore draws the same for every sample."""

    seed: int
    epoch: int


@dataclass(frozen=True)
class Batch:
    """Samples loaded by index: inputs ``x`` and targets ``y`` (None: no targets), each an array or
    a tree of arrays with the batch dimension first (for classification, float32 inputs and int64
    labels).

    ``skipped`` names the unreadable files that were replaced (``skip_corrupt``)."""

    x: Any
    y: Any = None
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
        for evaluation). An empty ``indices`` gives an empty batch of the right structure, shapes
        and dtypes (:meth:`DatasetSpec.empty`): an epoch's short last step can leave a rank none."""


@dataclass(frozen=True)
class Split(Source):
    """One split of a dataset in memory: inputs ``x`` and targets ``y`` (None: no targets), each a
    NumPy array or a tree of them, all of one length. For classification, float32 inputs and
    integer labels."""

    in_memory: ClassVar[bool] = True
    x: Any
    y: Any = None

    def __post_init__(self) -> None:
        lengths = {f"{name}{tree.path_name(path)}": len(array)
                   for name, part in (("x", self.x), ("y", self.y))
                   for path, array in tree.leaves_with_paths(part)}
        if not any(name.startswith("x") for name in lengths):
            raise HvdtrainError("dataset split has no input arrays")
        if len(set(lengths.values())) > 1:
            if set(lengths) == {"x", "y"}:
                raise HvdtrainError(f"dataset split has {lengths['x']} inputs but "
                                    f"{lengths['y']} labels")
            raise HvdtrainError("dataset split's arrays differ in length: "
                                + ", ".join(f"{name} {n}" for name, n in lengths.items()))

    def __len__(self) -> int:
        return tree.leading_size(self.x)

    def load(self, indices: np.ndarray, draw: Draw | None = None) -> Batch:
        return Batch(tree.take(self.x, indices), tree.take(self.y, indices))


class Dataset(abc.ABC):
    """A dataset plug-in: a training and a test :class:`Source`, the same on every rank.

    Subclass it and name it in the config as ``data.name: package.module:MyDataset``; the
    ``data.options`` mapping is passed to the constructor as keyword arguments. Problems a run
    would meet later (an empty class, shapes that differ between splits) are raised here, before
    training starts.
    """

    @abc.abstractmethod
    def spec(self) -> DatasetSpec:
        """What a sample holds (:class:`DatasetSpec`): the inputs' and targets' structure, shapes
        and dtypes, and the number of classes where there are classes."""

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
