"""Users' own ``torch.utils.data.Dataset`` classes, for the ``torch_dataset`` format's tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image


class PillowFolder(torch.utils.data.Dataset):
    """One folder per class of images, like torchvision's ``ImageFolder`` with ``ToTensor``."""

    def __init__(self, root: str) -> None:
        self.classes = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
        self.files = [(path, label) for label, name in enumerate(self.classes)
                      for path in sorted((Path(root) / name).iterdir())]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.files[index]
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255
        return torch.from_numpy(pixels.transpose(2, 0, 1).copy()), label


class Noise(torch.utils.data.Dataset):
    """Random inputs without a ``classes`` attribute."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.rand(4), index % 2
