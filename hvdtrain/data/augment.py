"""Image augmentation that a resumed or resized run draws again exactly: random crop and horizontal
flip, each sample's randomness drawn from ``(seed, epoch, sample index)`` alone.

Not from a generator that advances as samples are loaded: which worker loads a sample, and after
which others, changes with the worker count, a resume or an elastic resize.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hvdtrain.data.contracts import Draw
from hvdtrain.errors import HvdtrainError


@dataclass(frozen=True)
class Augment:
    """``random_crop``: pad each side by this many zero pixels and crop back to the original size
    at a random offset (0: no crop); ``flip``: mirror left-right with probability 1/2. Samples
    are (channels, height, width)."""

    random_crop: int = 0
    flip: bool = False

    @staticmethod
    def from_options(random_crop: int, flip: bool, shape: tuple[int, ...]) -> Augment | None:
        """The augmentation of the ``random_crop`` and ``flip`` options for samples of ``shape``,
        or None when both are off."""
        if not isinstance(random_crop, int) or isinstance(random_crop, bool) or random_crop < 0:
            raise HvdtrainError(f"data.options.random_crop={random_crop!r}: "
                                "expected an integer >= 0")
        if not isinstance(flip, bool):
            raise HvdtrainError(f"data.options.flip={flip!r}: expected true or false")
        if not random_crop and not flip:
            return None
        if len(shape) != 3:
            raise HvdtrainError(f"data.options: random_crop and flip need image samples "
                                f"(channels, height, width); these have shape {tuple(shape)}")
        return Augment(random_crop, flip)

    def sample(self, x: np.ndarray, index: int, draw: Draw) -> np.ndarray:
        """Sample ``index`` (CHW) augmented for ``draw``: the same arrays give the same result."""
        rng = np.random.default_rng([draw.seed, draw.epoch, int(index)])
        top, left = rng.integers(0, 2 * self.random_crop + 1, size=2)
        mirror = rng.random() < 0.5
        if self.random_crop:
            pad = self.random_crop
            padded = np.pad(x, ((0, 0), (pad, pad), (pad, pad)))
            x = padded[:, top:top + x.shape[1], left:left + x.shape[2]]
        if self.flip and mirror:
            x = x[:, :, ::-1]
        return np.ascontiguousarray(x)

    def batch(self, x: np.ndarray, indices: np.ndarray, draw: Draw) -> np.ndarray:
        """Every sample of a batch augmented; ``indices`` are the samples' indices in the split."""
        if not len(x):
            return x
        return np.stack([self.sample(row, i, draw) for row, i in zip(x, indices, strict=True)])
