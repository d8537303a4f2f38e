"""Arrays in ``.npy`` files, read through memory maps (``data.name: npy``): a split larger than
memory trains with bounded memory, since a rank reads only the rows of its own batches."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import BinaryIO

import numpy as np

from hvdtrain.data.augment import Augment
from hvdtrain.data.contracts import (
    Batch,
    BuiltDataset,
    DatasetSpec,
    Draw,
    Source,
    check_label_range,
)
from hvdtrain.errors import HvdtrainError


class MappedArray:
    """The array of one ``.npy`` file, memory-mapped read-only.

    :meth:`release` unmaps the pages this process has touched. They stay in the kernel's page cache,
    so a later read costs a minor fault, but the process's resident set stops growing with every
    row it has ever read: memory stays bounded by a batch, not by the data set.
    """

    def __init__(self, path: Path, what: str) -> None:
        if not path.is_file():
            raise HvdtrainError(f"data.options: {what} file {path} not found")
        try:
            with path.open("rb") as f:
                shape, fortran, dtype = read_header(f)
                if dtype.hasobject:
                    raise ValueError("it holds Python objects, which hvdtrain does not unpickle")
                offset = f.tell()
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.array = np.ndarray(shape, dtype, buffer=self.map, offset=offset,
                                    order="F" if fortran else "C")
        except (OSError, ValueError, TypeError) as exc:
            raise HvdtrainError(f"data.options: {what} file {path} is not a readable .npy: {exc}") \
                from None

    def release(self) -> None:
        """Drops this process's mappings of the file's pages (``MADV_DONTNEED``)."""
        self.map.madvise(mmap.MADV_DONTNEED)


def read_header(f: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Shape, Fortran order and dtype from an open ``.npy`` file, left at the start of the data."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(f)
    raise ValueError(f"format version {version} is not supported")


def load_labels(path: Path, what: str) -> np.ndarray:
    """A labels file read whole: labels are a few bytes a sample, and every one is range-checked."""
    if not path.is_file():
        raise HvdtrainError(f"data.options: {what} file {path} not found")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise HvdtrainError(f"data.options: {what} file {path} is not a readable .npy: "
                            f"{exc}") from None


class NpySource(Source):
    """Rows of a memory-mapped input array and its labels; inputs cast to float32 and scaled."""

    def __init__(self, x: MappedArray, y: np.ndarray, scale: float,
                 augment: Augment | None) -> None:
        self.mapped, self.x, self.y = x, x.array, y
        self.scale, self.augment = np.float32(scale), augment

    def __len__(self) -> int:
        return len(self.y)

    def load(self, indices: np.ndarray, draw: Draw | None = None) -> Batch:
        # Sorted reads touch the file in order; the batch keeps the requested order.
        order = np.argsort(indices, kind="stable")
        rows = np.empty((len(indices), *self.x.shape[1:]), np.float32)
        rows[order] = self.x[indices[order]]
        self.mapped.release()
        rows *= self.scale
        if self.augment is not None and draw is not None:
            rows = self.augment.batch(rows, indices, draw)
        return Batch(rows, np.asarray(self.y[indices], np.int64))


class NpyDataset(BuiltDataset):
    """``root/{train,test}_{x,y}.npy``: inputs of any shape (the batch first), integer labels.

    Options: ``root``; ``scale`` multiplies the inputs (``1/255`` for uint8 pixels);
    ``num_classes`` (0: the largest label plus one); ``random_crop`` and ``flip`` augment image
    samples (channels, height, width) of the training split
    (:class:`~hvdtrain.data.augment.Augment`). Mismatched lengths or shapes and labels out of range
    are errors before training.
    """

    def __init__(self, root: str, scale: float = 1.0, num_classes: int = 0, random_crop: int = 0,
                 flip: bool = False) -> None:
        base = Path(root)
        inputs = {name: MappedArray(base / f"{name}.npy", name) for name in ("train_x", "test_x")}
        labels = {name: load_labels(base / f"{name}.npy", name) for name in ("train_y", "test_y")}
        arrays = {**{name: mapped.array for name, mapped in inputs.items()}, **labels}
        for split in ("train", "test"):
            x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
            if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
                raise HvdtrainError(f"data.options: {split}_y.npy must hold integer labels in one "
                                    f"dimension; it has {y.dtype} of shape {y.shape}")
            if len(x) != len(y) or not len(y):
                raise HvdtrainError(f"data.options: {split}_x.npy has {len(x)} samples, "
                                    f"{split}_y.npy {len(y)} labels (must be equal and not 0)")
        shapes = arrays["train_x"].shape[1:], arrays["test_x"].shape[1:]
        if shapes[0] != shapes[1]:
            raise HvdtrainError(f"data.options: train_x.npy samples have shape {shapes[0]}, "
                                f"test_x.npy samples {shapes[1]}")
        classes = num_classes or int(max(arrays["train_y"].max(), arrays["test_y"].max())) + 1
        for split in ("train", "test"):
            check_label_range(arrays[f"{split}_y"], classes, f"{base / split}_y.npy")
        augment = Augment.from_options(random_crop, flip, shapes[0])
        self._spec = DatasetSpec(input_shape=tuple(shapes[0]), num_classes=classes)
        self._train = NpySource(inputs["train_x"], arrays["train_y"], scale, augment)
        self._test = NpySource(inputs["test_x"], arrays["test_y"], scale, None)

