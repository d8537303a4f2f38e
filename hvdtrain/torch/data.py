"""PyTorch data loading: a ``DataLoader`` driven by hvdtrain's sampler plan, and a user's own
``torch.utils.data.Dataset`` as an hvdtrain data set (``data.name: torch_dataset``).

The ``DataLoader``'s batch sampler yields :class:`~hvdtrain.data.loading.Request` objects, one per
micro-batch, in the order of the epoch's plan; its persistent worker processes load them
(``__getitems__``) and keep ``prefetch`` each ready. See :mod:`hvdtrain.data.loading` for why
this cannot change which samples a step trains on. Batches are ``(inputs, targets)``: every array
of the source's trees (:mod:`hvdtrain.data.tree`) becomes a tensor on the rank's device, the
structure stays.
"""

from __future__ import annotations

import atexit
import multiprocessing.context
import multiprocessing.popen_fork
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data

from hvdtrain.data import tree
from hvdtrain.data.contracts import ArraySpec, Batch, BuiltDataset, DatasetSpec, Draw, Source
from hvdtrain.data.loading import (
    Loaded,
    PlanCursor,
    Request,
    SkipReport,
    check_loaded,
    eval_requests,
    fetch,
    load_direct,
)
from hvdtrain.data.sampler import StepIndices
from hvdtrain.errors import HvdtrainError
from hvdtrain.registry import import_object
from hvdtrain.signals import ignore_in_helper
from hvdtrain.torch.device import pinned, pins_memory, to_device

Item = tuple[np.ndarray, Any, Any, tuple[str, ...], str]
"""What a worker hands back: indices, the inputs' and targets' trees of tensors (None on error),
skipped files, error."""
Pair = tuple[Any, Any]
"""A batch as the engine takes it: ``(inputs, targets)``, trees of tensors (targets may be None)."""


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


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def _as_tensors(x: Any, y: Any) -> Pair:
    """A batch's trees of arrays as trees of tensors sharing their memory."""
    return tree.map_tree(_tensor, x), tree.map_tree(_tensor, y)


def _collate(loaded: Loaded) -> Item:
    """Tensors made in the worker travel to the training process through shared memory."""
    if loaded.error:
        return loaded.indices, None, None, (), loaded.error
    return (loaded.indices, *_as_tensors(loaded.x, loaded.y), loaded.skipped, "")


def _worker_init(worker_id: int) -> None:
    """Runs first in every worker: a stop signal sent to every process of a Slurm step (preemption,
    ``scancel``, the time limit) is the rank's to act on; killed by it, the worker would end the
    rank with an error and no checkpoint."""
    ignore_in_helper()


class _Popen(multiprocessing.popen_fork.Popen):
    """A worker's process handle whose ``terminate`` is SIGKILL: the worker ignores SIGTERM, and
    torch (a worker that did not leave when shut down) and multiprocessing (at exit) end workers
    with ``terminate``, then wait for them."""

    def terminate(self) -> None:
        self.kill()


class _Process(multiprocessing.context.ForkProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:
        return _Popen(process_obj)


class _Fork(multiprocessing.context.ForkContext):
    """The ``fork`` start method (Linux's default), with :class:`_Popen` handles."""

    Process = _Process


def _end_workers(ref: weakref.ref[torch.utils.data.DataLoader]) -> None:
    """At the process's exit, before multiprocessing's own exit hook (``atexit`` runs the hook
    registered last first): ends a loader's workers by torch's shutdown, which stops watching them
    first. Left to multiprocessing's hook, a worker is killed while torch's SIGCHLD handler still
    watches it, and the rank, exiting anyway (75 after a stop), prints that its worker "is killed
    by signal". Torch has no public call for this: its own iterator's ``__del__`` makes it."""
    loader = ref()
    iterator = None if loader is None else getattr(loader, "_iterator", None)
    if iterator is not None:
        iterator._shutdown_workers()


class TorchLoader:
    """Loads the batches of the sampler's steps and of evaluations as tensors.

    Sources on disk go through a ``DataLoader`` with ``workers`` persistent processes (none when
    ``workers`` is 0, or for sources in memory: those are gathered on the training thread). Each
    batch is yielded on ``device``, every tensor of its trees. For a CUDA ``device`` it is staged
    in pinned memory first (the ``DataLoader``'s pinning thread, or a pin on the training thread
    for batches gathered there), so that the non-blocking copy to the GPU really is one; on CPU
    nothing is pinned or copied. The loader has its own
    generator, so opening a stream draws nothing from torch's global one, which a resumed run
    restores. The workers ignore stop signals (SIGTERM, SIGUSR1) and SIGINT, which the rank acts
    on; it ends its workers when it exits (SIGKILL for one that does not leave when asked).
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
                # The DataLoader hands each of batch_sampler's items (a Request here, where its
                # annotations say a list of indices) to __getitems__ and the result to collate_fn.
                _SourcesDataset(self.sources),
                batch_sampler=self._requests,  # type: ignore[arg-type]
                num_workers=workers,
                collate_fn=_collate,  # type: ignore[arg-type]
                pin_memory=pins_memory(device), prefetch_factor=prefetch,
                persistent_workers=True, generator=torch.Generator().manual_seed(seed),
                worker_init_fn=_worker_init, multiprocessing_context=_Fork())
            # Fork the workers now, before the run opens its pipes: a worker forked later would
            # hold the metrics writer's stdin open, and the writer would never see its end.
            self._stream = iter(self._loader)
            atexit.register(_end_workers, weakref.ref(self._loader))

    def _direct(self, split: str) -> bool:
        return self._loader is None or self.sources[split].in_memory

    def _workers(self) -> torch.utils.data.DataLoader:
        """The loader with worker processes, which a split that is not :meth:`_direct` has."""
        if self._loader is None:
            raise RuntimeError("TorchLoader: no worker processes for a split that needs them")
        return self._loader

    def batches(self, step: StepIndices) -> Iterator[Pair]:
        """The step's micro-batches, in order, as ``(inputs, targets)`` on the device."""
        if self._direct("train"):
            draw = Draw(self.seed, step.plan.epoch if step.plan else 0)
            for idx in step.micro:
                yield self._load(Request("train", idx, draw))
            return
        stream = self._stream
        if stream is None or not self.cursor.follows(step):  # None: no stream was opened yet
            self._requests.requests = self.cursor.open(step, self.seed)
            stream = self._stream = iter(self._workers())
        self.cursor.advance()  # the stream is now past this step, however far the caller reads
        for idx in step.micro:
            yield self._tensors(next(stream), idx)

    def eval_batches(self, batches: Iterable[np.ndarray]) -> Iterator[Pair]:
        """The test split's batches, in order, as ``(inputs, targets)`` on the device."""
        requests = eval_requests(batches)
        if self._direct("test"):
            for request in requests:
                yield self._load(request)
            return
        self.cursor.close()
        self._requests.requests = requests
        stream = iter(self._workers())
        for request in requests:
            yield self._tensors(next(stream), request.indices)

    def _load(self, request: Request) -> Pair:
        """A batch loaded on the training thread, pinned for a GPU as the ``DataLoader`` would."""
        batch = load_direct(self.sources, request, self.skips)
        pair = _as_tensors(batch.x, batch.y)
        return self._placed(tree.unflatten(pair, pinned(self.device, *tree.leaves(pair))))

    def _tensors(self, item: Item, expected: np.ndarray) -> Pair:
        indices, x, y, skipped, error = item
        check_loaded(Loaded(indices, None, None, error=error), expected)
        self.skips.note(skipped)
        return self._placed((x, y))

    def _placed(self, pair: Pair) -> Pair:
        """The batch on the rank's device; from pinned memory the copy does not wait for the GPU."""
        return tree.unflatten(pair, to_device(self.device, *tree.leaves(pair)))


def _array(value: Any) -> np.ndarray:
    """One leaf of a user's item as an array; float64 (NumPy's default) becomes float32 (torch's,
    and the models' weights')."""
    array = np.asarray(value)
    return array.astype(np.float32) if array.dtype == np.float64 else array


def _is_label(spec: Any) -> bool:
    return isinstance(spec, ArraySpec) and spec.shape == () and np.dtype(spec.dtype).kind in "iu"


class TorchDatasetSource(Source):
    """A map-style ``torch.utils.data.Dataset`` as a source.

    An item that is a pair (a tuple or list of two) is ``(inputs, targets)``; any other item (a
    tensor, an array, a dict) is inputs alone, without targets. Inputs and targets are tensors,
    arrays or numbers, or tuples, lists and dicts of them, the same structure and shapes for
    every item. Their dtypes stay, except float64, which becomes float32; and for classification
    (one input array and one integer label an item) inputs are float32 and labels int64, as
    ``torchvision``'s datasets give them.
    """

    def __init__(self, dataset: Any, name: str) -> None:
        self.dataset, self.name = dataset, name
        self.classify = False
        self.inputs: Any = None
        self.targets: Any = None
        if len(self):
            inputs, targets = self._sample(0)
            self.classify = (not tree.is_node(inputs) and not tree.is_node(targets)
                             and _is_label(ArraySpec.of(targets, batched=False)))
            self.inputs, self.targets = (tree.map_tree(lambda a: ArraySpec.of(a, False), part)
                                         for part in self._typed(inputs, targets))

    def __len__(self) -> int:
        return len(self.dataset)

    def _sample(self, index: int) -> tuple[Any, Any]:
        try:
            item = self.dataset[index]
            pair = item if isinstance(item, (tuple, list)) and len(item) == 2 else (item, None)
            return tree.map_tree(_array, pair[0]), tree.map_tree(_array, pair[1])
        except Exception as exc:  # noqa: BLE001  (a user's dataset raises anything: say where)
            first = str(exc).strip().splitlines()[:1]
            raise HvdtrainError(f"{self.name}[{index}]: {type(exc).__name__}: "
                                f"{first[0] if first else ''}") from None

    def _typed(self, inputs: Any, targets: Any) -> tuple[Any, Any]:
        """The classification short path's dtypes: float32 inputs, int64 labels."""
        if not self.classify:
            return inputs, targets
        return inputs.astype(np.float32, copy=False), targets.astype(np.int64, copy=False)

    def spec(self, num_classes: int | None) -> DatasetSpec:
        """The samples' spec (read off the first item)."""
        return DatasetSpec(inputs=self.inputs, targets=self.targets, num_classes=num_classes)

    def load(self, indices: np.ndarray, draw: Draw | None = None) -> Batch:
        samples = [self._typed(*self._sample(int(i))) for i in indices]
        if not samples:
            return self.spec(None).empty()
        where = f"{self.name}[{int(indices[0])}...]"
        return Batch(tree.stack([x for x, _ in samples], f"{where} inputs"),
                     tree.stack([y for _, y in samples], f"{where} targets"))


class TorchDatasets(BuiltDataset):
    """A user's own ``torch.utils.data.Dataset`` objects (``data.name: torch_dataset``).

    ``train`` and ``test`` are import paths ``package.module:Name`` of a class or function that
    returns the split's dataset, called with ``train_options`` and ``test_options``; e.g.
    ``torchvision.datasets:ImageFolder`` with ``{root: ..., transform: ...}``. Items are
    ``(inputs, targets)`` pairs or inputs alone, of any structure, dtypes and fixed shapes (see
    :class:`TorchDatasetSource`): ``(image, label)``, ``(tokens, next_tokens)``,
    ``({"tokens": ..., "mask": ...}, next_tokens)``. For classification (one integer label an
    item) ``num_classes`` (0: the train split's ``classes`` attribute, as ImageFolder has) sets
    the output size; for other targets it is optional.
    """

    def __init__(self, train: str, test: str, train_options: dict | None = None,
                 test_options: dict | None = None, num_classes: int = 0) -> None:
        self._train = TorchDatasetSource(self._make(train, train_options), f"train dataset {train}")
        self._test = TorchDatasetSource(self._make(test, test_options), f"test dataset {test}")
        for source in (self._train, self._test):
            if not len(source):
                raise HvdtrainError(f"data.options: the {source.name} is empty")
        self._check_alike(self._train, self._test)
        classes = num_classes or len(getattr(self._train.dataset, "classes", ()))
        if self._train.classify and classes < 1:
            raise HvdtrainError(f"data.options.num_classes: give it; {train} has no `classes`")
        self._spec = self._train.spec(classes or None)

    @staticmethod
    def _check_alike(train: TorchDatasetSource, test: TorchDatasetSource) -> None:
        if (train.inputs, train.targets) == (test.inputs, test.targets):
            return
        if train.classify and test.classify:
            raise HvdtrainError(f"data.options: the train samples have shape {train.inputs.shape}, "
                                f"the test samples {test.inputs.shape}")
        raise HvdtrainError(
            f"data.options: the train items are {tree.describe((train.inputs, train.targets))}, "
            f"the test items {tree.describe((test.inputs, test.targets))}")

    @staticmethod
    def _make(path: str, options: dict | None) -> Any:
        factory = import_object(path)
        try:
            return factory(**(options or {}))
        except TypeError as exc:
            raise HvdtrainError(f"data.options for {path!r}: {exc}") from None
