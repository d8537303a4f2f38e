"""scikit-learn's bundled handwritten digits, in memory (the ``digits`` data set)."""

from __future__ import annotations

import numpy as np

from hvdtrain.data.contracts import Dataset, DatasetSpec, Split
from hvdtrain.errors import HvdtrainError


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
