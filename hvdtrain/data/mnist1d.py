"""MNIST-1D (Greydanus, 2020): 10 classes of 40-sample 1-D signals, generated locally.

``mnist1d.data.make_dataset`` builds it from the package's bundled templates with the package's
default arguments (4,000 training and 1,000 test samples, seed 42), so every rank makes the same
arrays with no download (``get_dataset``, which downloads, is never used). Harder than digits: an
MLP reaches about 0.6-0.7, which spreads the compression methods apart.
"""

from __future__ import annotations

import numpy as np

from hvdtrain.data.contracts import Dataset, DatasetSpec, Split


class Mnist1dDataset(Dataset):
    """MNIST-1D with the package defaults, as float32 inputs of 40 features."""

    def __init__(self) -> None:
        from mnist1d.data import get_dataset_args, make_dataset

        data = make_dataset(get_dataset_args())
        self._train = Split(data["x"].astype(np.float32), data["y"].astype(np.int64))
        self._test = Split(data["x_test"].astype(np.float32), data["y_test"].astype(np.int64))
        self._length = int(data["x"].shape[1])

    def spec(self) -> DatasetSpec:
        return DatasetSpec(input_shape=(self._length,), num_classes=10)

    def train(self) -> Split:
        return self._train

    def test(self) -> Split:
        return self._test
