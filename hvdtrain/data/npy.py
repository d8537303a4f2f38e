"""Arrays in ``.npy`` files, read through memory maps (``data.name: npy``): a split larger than
memory trains with bounded memory, since a rank reads only the rows of its own batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hvdtrain.data.augment import Augment
from hvdtrain.data.contracts import Batch, BuiltDataset, DatasetSpec, Draw, Source, check_label_range
from hvdtrain.errors import HvdtrainError


def open_array(path: Path, what: str) -> np.ndarray:
    """The array in ``path``, memory-mapped; a missing or unreadable file names itself."""
    if not path.is_file():
        raise HvdtrainError(f"data.options: {what} file {path} not found")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise HvdtrainError(f"data.options: {what} file {path} is not a readable .npy: {exc}") from None


class NpySource(Source):
    """Rows of a memory-mapped input array and its labels; inputs cast to float32 and scaled."""

    def __init__(self, x: np.ndarray, y: np.ndarray, scale: float, augment: Augment | None) -> None:
        self.x, self.y, self.scale, self.augment = x, y, np.float32(scale), augment

    def __len__(self) -> int:
        return len(self.y)

    def load(self, indices: np.ndarray, draw: Draw | None = None) -> Batch:
        # Sorted reads touch the file in order; the batch keeps the requested order.
        order = np.argsort(indices, kind="stable")
        rows = np.empty((len(indices), *self.x.shape[1:]), np.float32)
        rows[order] = self.x[indices[order]]
        rows *= self.scale
        if self.augment is not None and draw is not None:
            rows = self.augment.batch(rows, indices, draw)
        return Batch(rows, np.asarray(self.y[indices], np.int64))


class NpyDataset(BuiltDataset):
    """``root/{train,test}_{x,y}.npy``: inputs of any shape (the batch first), integer labels.

    Options: ``root``; ``scale`` multiplies the inputs (``1/255`` for uint8 pixels);
    ``num_classes`` (0: the largest label plus one); ``random_crop`` and ``flip`` augment image
    samples (channels, height, width) of the training split (:class:`~hvdtrain.data.augment.Augment`).
    Mismatched lengths or shapes and labels out of range are errors before training.
    """

    def __init__(self, root: str, scale: float = 1.0, num_classes: int = 0, random_crop: int = 0,
                 flip: bool = False) -> None:
        base = Path(root)
        arrays = {name: open_array(base / f"{name}.npy", name)
                  for name in ("train_x", "train_y", "test_x", "test_y")}
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
            check_label_range(np.asarray(arrays[f"{split}_y"]), classes, f"{base / split}_y.npy")
        augment = Augment.from_options(random_crop, flip, shapes[0])
        self._spec = DatasetSpec(input_shape=tuple(shapes[0]), num_classes=classes)
        self._train = NpySource(arrays["train_x"], arrays["train_y"], scale, augment)
        self._test = NpySource(arrays["test_x"], arrays["test_y"], scale, None)

