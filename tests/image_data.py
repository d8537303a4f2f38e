"""Small on-disk data sets for the data tests: generated JPEG folders and their ``.npy`` copies."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hvdtrain.data.image_folder import ImageFolder
from hvdtrain.data.make_images import make_images


def image_folder(root: Path, train: int = 200, test: int = 60, size: int = 16) -> Path:
    """``make_images`` into ``root`` (once: an existing folder is reused)."""
    if not (root / "train").is_dir():
        make_images(root, train, test, size)
    return root


def npy_copy(images: Path, out: Path, size: int) -> Path:
    """The images of ``images`` decoded once into ``out/{train,test}_{x,y}.npy`` as uint8 pixels
    (read back with ``scale: 1/255``)."""
    if (out / "test_y.npy").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    folder = ImageFolder(str(images), size=size)
    for split, source in (("train", folder.train()), ("test", folder.test())):
        batch = source.load(np.arange(len(source)))
        np.save(out / f"{split}_x.npy", np.round(batch.x * 255).astype(np.uint8))
        np.save(out / f"{split}_y.npy", batch.y)
    return out
