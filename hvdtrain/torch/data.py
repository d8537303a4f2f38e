"""PyTorch data loading: a ``DataLoader`` driven by hvdtrain's sampler plan, and a user's own
``torch.utils.data.Dataset`` as an hvdtrain data set (``data.name: torch_dataset``).

The ``DataLoader``'s batch sampler yields :class:`~hvdtrain.data.loading.Request` objects, one per
micro-batch, in the order of the epoch's plan; its persistent worker processes load them
(``__getitems__``) and keep ``prefetch`` each ready. See :mod:`hvdtrain.data.loading` for why
this cannot change which samples a step trains on.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.utils.data

from hvdtrain.data.contracts import Batch, BuiltDataset, DatasetSpec, Draw, Source
from hvdtrain.data.loading import (Loaded, PlanCursor, Request, SkipReport, check_loaded,
                                   eval_requests, fetch, load_direct)
from hvdtrain.data.sampler import StepIndices
from hvdtrain.errors import HvdtrainError
from hvdtrain.registry import import_object
from hvdtrain.torch.device import pinned, pins_memory

Item = tuple[np.ndarray, Any, Any, tuple[str, ...], str]
"""What a worker hands back: indices, x and y tensors (None on error), skipped files, error."""


class _Requests:
    """The ``DataLoader``'s batch sampler: the requests of the stream being opened."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __len__(self) -> int:
        return len(self.requests)


class _SourcesDataset(torch.utils.data.Dataset):
    """hvdtrain's two sources as a torch Dataset whose items are whole micro-batches."""

    def __init__(self, sources: dict[str, Source]) -> None:
        self.sources = sources

    def __len__(self) -> int:
        return len(self.sources["train"])

    def __getitem__(self, request: Request) -> Loaded:
        return fetch(self.sources, request)

    def __getitems__(self, request: Request) -> Loaded:
        return fetch(self.sources, request)


def _as_tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's arrays as tensors sharing their memory."""
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


def _collate(loaded: Loaded) -> Item:
    """Tensors made in the worker travel to the training process through shared memory."""
    if loaded.error:
        return loaded.indices, None, None, (), loaded.error
    return (loaded.indices, *_as_tensors(loaded.x, loaded.y), loaded.skipped, "")


class TorchLoader:
    """Loads the batches of the sampler's steps and of evaluations as tensors.

    Sources on disk go through a ``DataLoader`` with ``workers`` persistent processes (none when
    ``workers`` is 0, or for sources in memory: those are gathered on the training thread). For a
    CUDA ``device`` every batch is handed over in pinned memory (the ``DataLoader``'s pinning
    thread, or a pin on the training thread for batches gathered there), so that the engine's
    non-blocking copy to the GPU really is one; on CPU nothing is pinned. The loader has its own
    generator, so opening a stream draws nothing from torch's global one, which a resumed run
    restores.
    """

    def __init__(self, train: Source, test: Source, *, seed: int, rank: int, workers: int,
                 prefetch: int, device: torch.device = torch.device("cpu")) -> None:
        self.sources = {"train": train, "test": test}
        self.seed = seed
        self.device = device
        self.cursor = PlanCursor()
        self.skips = SkipReport(rank)
        self._requests = _Requests()
        self._stream: Iterator[Item] | None = None
        self._loader: torch.utils.data.DataLoader | None = None
        if workers > 0 and not (train.in_memory and test.in_memory):
            self._loader = torch.utils.data.DataLoader(
                _SourcesDataset(self.sources), batch_sampler=self._requests, num_workers=workers,
                collate_fn=_collate, pin_memory=pins_memory(device), prefetch_factor=prefetch,
                persistent_workers=True, generator=torch.Generator().manual_seed(seed))
            # Fork the workers now, before the run opens its pipes: a worker forked later would
            # hold the metrics writer's stdin open, and the writer would never see its end.
            self._stream = iter(self._loader)

    def _direct(self, split: str) -> bool:
        return self._loader is None or self.sources[split].in_memory

    def batches(self, step: StepIndices) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The step's micro-batches, in order, as ``(x, y)``."""
        if self._direct("train"):
            draw = Draw(self.seed, step.plan.epoch if step.plan else 0)
            for idx in step.micro:
                yield self._load(Request("train", idx, draw))
            return
        if not self.cursor.follows(step):
            self._requests.requests = self.cursor.open(step, self.seed)
            self._stream = iter(self._loader)
        self.cursor.advance()  # the stream is now past this step, however far the caller reads
        for idx in step.micro:
            yield self._tensors(next(self._stream), idx)

    def eval_batches(self, batches: Iterable[np.ndarray]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The test split's batches, in order, as ``(x, y)``."""
        requests = eval_requests(batches)
        if self._direct("test"):
            for request in requests:
                yield self._load(request)
            return
        self.cursor.close()
        self._requests.requests = requests
        stream = iter(self._loader)
        for request in requests:
            yield self._tensors(next(stream), request.indices)

    def _load(self, request: Request) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch loaded on the training thread, pinned for a GPU as the ``DataLoader`` would."""
        batch = load_direct(self.sources, request, self.skips)
        return pinned(self.device, *_as_tensors(batch.x, batch.y))

    def _tensors(self, item: Item, expected: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        indices, x, y, skipped, error = item
        check_loaded(Loaded(indices, None, None, error=error), expected)
        self.skips.note(skipped)
        return x, y


class TorchDatasetSource(Source):
    """A map-style ``torch.utils.data.Dataset`` whose items are ``(input, label)`` as a source."""

    def __init__(self, dataset: Any, name: str) -> None:
        self.dataset, self.name = dataset, name
        self.shape = tuple(np.shape(self._sample(0)[0])) if len(self) else ()

    def __len__(self) -> int:
        return len(self.dataset)

    def _sample(self, index: int) -> tuple[np.ndarray, int]:
        try:
            x, y = self.dataset[index]
            return np.asarray(x, dtype=np.float32), int(y)
        except Exception as exc:  # a user's dataset may raise anything: name where, in one line
            first = str(exc).strip().splitlines()[:1]
            raise HvdtrainError(f"{self.name}[{index}]: {type(exc).__name__}: "
                                f"{first[0] if first else ''}") from None

    def load(self, indices: np.ndarray, draw: Draw | None = None) -> Batch:
        samples = [self._sample(int(i)) for i in indices]
        if not samples:
            return Batch(np.zeros((0, *self.shape), np.float32), np.zeros(0, np.int64))
        return Batch(np.stack([x for x, _ in samples]), np.array([y for _, y in samples], np.int64))


class TorchDatasets(BuiltDataset):
    """A user's own ``torch.utils.data.Dataset`` objects (``data.name: torch_dataset``).

    ``train`` and ``test`` are import paths ``package.module:Name`` of a class or function that
    returns the split's dataset, called with ``train_options`` and ``test_options``; e.g.
    ``torchvision.datasets:ImageFolder`` with ``{root: ..., transform: ...}``. Items are
    ``(input, label)`` with a fixed input shape. ``num_classes`` (0: the train split's
    ``classes`` attribute, as ImageFolder has) sets the output size.
    """

    def __init__(self, train: str, test: str, train_options: dict | None = None,
                 test_options: dict | None = None, num_classes: int = 0) -> None:
        self._train = TorchDatasetSource(self._make(train, train_options), f"train dataset {train}")
        self._test = TorchDatasetSource(self._make(test, test_options), f"test dataset {test}")
        for source in (self._train, self._test):
            if not len(source):
                raise HvdtrainError(f"data.options: the {source.name} is empty")
        if self._train.shape != self._test.shape:
            raise HvdtrainError(f"data.options: the train samples have shape {self._train.shape}, "
                                f"the test samples {self._test.shape}")
        classes = num_classes or len(getattr(self._train.dataset, "classes", ()))
        if classes < 1:
            raise HvdtrainError(f"data.options.num_classes: give it; {train} has no `classes`")
        self._spec = DatasetSpec(input_shape=self._train.shape, num_classes=classes)

    @staticmethod
    def _make(path: str, options: dict | None) -> Any:
        factory = import_object(path)
        try:
            return factory(**(options or {}))
        except TypeError as exc:
            raise HvdtrainError(f"data.options for {path!r}: {exc}") from None

