"""A synthetic image dataset generated in process: no download, any size, learnable.

Each class has a fixed random template image; a sample is its class's template plus Gaussian
noise. A model must look at the pixels to tell classes apart, so training accuracy rises as it
would on real data, while the size (samples, channels, height, width, classes) is free: the
benchmarks use it to feed a ResNet-18-sized network with inputs of a realistic shape. Everything
is drawn from one seeded generator, so every rank builds exactly the same arrays without
communicating.
"""

from __future__ import annotations

import numpy as np

from hvdtrain.data.contracts import BuiltDataset, DatasetSpec, Split
from hvdtrain.errors import HvdtrainError


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HvdtrainError(f"data.options.{name}={value!r}: expected a positive integer")
    return value


class SyntheticImages(BuiltDataset):
    """Class templates plus noise, in NCHW float32 (options below are ``data.options`` keys).

    ``train_samples`` and ``test_samples`` set the split sizes, ``channels``, ``height`` and
    ``width`` the image shape, ``num_classes`` the labels, ``noise`` the noise's standard
    deviation relative to the templates' (1.0: as strong as the signal), ``seed`` the generator.
    """

    def __init__(self, train_samples: int = 2048, test_samples: int = 512, channels: int = 3,
                 height: int = 32, width: int = 32, num_classes: int = 10, noise: float = 1.0,
                 seed: int = 0) -> None:
        sizes = dict(train_samples=train_samples, test_samples=test_samples, channels=channels,
                     height=height, width=width, num_classes=num_classes)
        for name, value in sizes.items():
            _positive(name, value)
        if not isinstance(noise, (int, float)) or isinstance(noise, bool) or noise < 0:
            raise HvdtrainError(f"data.options.noise={noise!r}: expected a number >= 0")
        self._spec = DatasetSpec(input_shape=(channels, height, width), num_classes=num_classes)
        rng = np.random.default_rng(seed)
        templates = rng.standard_normal((num_classes, channels, height, width), dtype=np.float32)
        self._train = self._draw(rng, templates, train_samples, float(noise))
        self._test = self._draw(rng, templates, test_samples, float(noise))

    @staticmethod
    def _draw(rng: np.random.Generator, templates: np.ndarray, count: int, noise: float) -> Split:
        labels = rng.integers(0, len(templates), size=count, dtype=np.int64)
        x = rng.standard_normal((count, *templates.shape[1:]), dtype=np.float32)
        x *= np.float32(noise)
        x += templates[labels]
        return Split(x, labels)
