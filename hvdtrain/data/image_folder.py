"""One directory per class of JPEG or PNG files (``data.name: image_folder``): the layout that
torchvision's ``ImageFolder`` and Keras' ``image_dataset_from_directory`` read.

``root/train/<class>/*.jpg`` and ``root/test/<class>/*.jpg``; classes are the train split's
folder names in sorted order. Images are decoded with Pillow, converted to RGB, resized to
``size x size`` and scaled to [0, 1], channels first, in the loader's workers (both frameworks
decode the same way, so they train on the same numbers).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hvdtrain.data.augment import Augment
from hvdtrain.data.contracts import Batch, BuiltDataset, DatasetSpec, Draw, Source
from hvdtrain.errors import HvdtrainError

EXTENSIONS = (".jpg", ".jpeg", ".png")


def decode(path: str, size: int) -> np.ndarray:
    """The image at ``path`` as float32 (3, size, size) in [0, 1]; an unreadable or truncated
    file raises :class:`HvdtrainError` naming it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image = image.convert("RGB")
            if image.size != (size, size):
                image = image.resize((size, size), Image.Resampling.BILINEAR)
            pixels = np.asarray(image, dtype=np.float32)
    except (OSError, ValueError, SyntaxError, UnidentifiedImageError) as exc:
        raise HvdtrainError(f"cannot read image {path}: {exc}") from None
    return pixels.transpose(2, 0, 1) / np.float32(255.0)


class ImageFiles(Source):
    """Image files and their labels, decoded on load.

    With ``skip_corrupt`` an unreadable file is replaced by the next readable one in the split's
    order (wrapping around), the same on every rank and in every run, and reported in
    :attr:`Batch.skipped`; without it the file stops the run.
    """

    def __init__(self, paths: list[str], labels: np.ndarray, size: int, augment: Augment | None,
                 skip_corrupt: bool) -> None:
        self.paths, self.labels, self.size = paths, labels, size
        self.augment, self.skip_corrupt = augment, skip_corrupt

    def __len__(self) -> int:
        return len(self.paths)

    def _read(self, index: int, skipped: list[str]) -> tuple[np.ndarray, int]:
        if not self.skip_corrupt:
            return decode(self.paths[index], self.size), index
        for offset in range(len(self.paths)):
            candidate = (index + offset) % len(self.paths)
            try:
                return decode(self.paths[candidate], self.size), candidate
            except HvdtrainError as exc:
                skipped.append(f"{exc}; replaced by the next readable image")
        raise HvdtrainError(f"no image of {Path(self.paths[0]).parent.parent} can be read")

    def load(self, indices: np.ndarray, draw: Draw | None = None) -> Batch:
        x = np.empty((len(indices), 3, self.size, self.size), np.float32)
        y = np.empty(len(indices), np.int64)
        skipped: list[str] = []
        for row, index in enumerate(indices):
            x[row], used = self._read(int(index), skipped)
            y[row] = self.labels[used]
        if self.augment is not None and draw is not None:
            x = self.augment.batch(x, indices, draw)
        return Batch(x, y, tuple(skipped))


def list_images(split_dir: Path, classes: list[str] | None
                ) -> tuple[list[str], np.ndarray, list[str]]:
    """The image files of one split, sorted, their labels and the class names (``classes`` for the
    test split: the train split's). An empty class folder is an error."""
    if not split_dir.is_dir():
        raise HvdtrainError(f"data.options.root: {split_dir} is not a directory")
    found = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
    if not found:
        raise HvdtrainError(f"data.options.root: {split_dir} has no class folders")
    if classes is not None and found != classes:
        raise HvdtrainError(f"data.options.root: the classes of {split_dir} ({', '.join(found)}) "
                            f"differ from the train split's ({', '.join(classes)})")
    paths: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(found):
        files = sorted(str(p) for p in (split_dir / name).iterdir()
                       if p.suffix.lower() in EXTENSIONS and p.is_file())
        if not files:
            raise HvdtrainError(f"data.options.root: class folder {split_dir / name} holds no "
                                f"{'/'.join(e[1:].upper() for e in EXTENSIONS)} image")
        paths += files
        labels += [label] * len(files)
    return paths, np.array(labels, np.int64), found


class ImageFolder(BuiltDataset):
    """Class-per-folder images under ``root`` (``train`` and ``test`` sub-folders).

    Options: ``root``; ``size`` (pixels of the square images the model sees, default 32);
    ``random_crop`` and ``flip`` augment the training split
    (:class:`~hvdtrain.data.augment.Augment`); ``skip_corrupt`` replaces unreadable images instead
    of stopping (see :class:`ImageFiles`).
    """

    def __init__(self, root: str, size: int = 32, random_crop: int = 0, flip: bool = False,
                 skip_corrupt: bool = False) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise HvdtrainError(f"data.options.size={size!r}: expected a positive integer")
        train_paths, train_labels, classes = list_images(Path(root) / "train", None)
        test_paths, test_labels, _ = list_images(Path(root) / "test", classes)
        augment = Augment.from_options(random_crop, flip, (3, size, size))
        self.classes = classes
        self._spec = DatasetSpec(input_shape=(3, size, size), num_classes=len(classes))
        self._train = ImageFiles(train_paths, train_labels, size, augment, bool(skip_corrupt))
        self._test = ImageFiles(test_paths, test_labels, size, None, bool(skip_corrupt))

