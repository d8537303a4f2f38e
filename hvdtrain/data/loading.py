"""What the PyTorch and TensorFlow loaders share: the requests their workers fetch, where their
stream stands in an epoch's plan, bad-data reports, and how many workers a rank gets.

The sampler decides which samples a step trains on; a loader only fetches them ahead of time, in
the plan's order. A stream is opened at a step and yields the micro-batches of that step and every
step after it in its :class:`~hvdtrain.data.sampler.EpochPlan`; any step that does not follow
(a new epoch, a resume, an elastic resize, an evaluation in between) opens a new one. So loading in
parallel cannot change which samples a step trains on, nor their order.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdtrain.data.contracts import Batch, Draw, Source
from hvdtrain.data.sampler import StepIndices
from hvdtrain.errors import HvdtrainError
from hvdtrain.horovod_start import compute_threads

MAX_AUTO_WORKERS = 8
"""The most loader workers ``data.workers: -1`` gives a rank."""


def loader_workers(configured: int, local_size: int) -> int:
    """Loader workers for one rank: ``configured`` when 0 or more, else half the cores the rank
    has (:func:`hvdtrain.horovod_start.compute_threads`), at least 1 and at most
    :data:`MAX_AUTO_WORKERS`.

    Half: the workers decode while the rank's compute threads train on the same cores, and a
    worker per core would take them from the compute. At least one, so that loading overlaps the
    step even on a rank with one core.
    """
    if configured >= 0:
        return configured
    return max(1, min(MAX_AUTO_WORKERS, compute_threads(0, local_size) // 2))


@dataclass(frozen=True)
class Request:
    """One micro-batch to load: which split, which samples, and the augmentation draw (None for
    evaluation). Picklable: PyTorch sends it to a worker process."""

    split: str
    indices: np.ndarray
    draw: Draw | None = None


@dataclass(frozen=True)
class Loaded:
    """A request's result as a worker hands it back: the batch's inputs and targets (trees of
    arrays, as the source gave them), or the one-line error that stops the run (raised by the
    training process, not inside the worker)."""

    indices: np.ndarray
    x: Any
    y: Any
    skipped: tuple[str, ...] = ()
    error: str = ""


def fetch(sources: dict[str, Source], request: Request) -> Loaded:
    """Loads ``request`` from its split; a data error becomes :attr:`Loaded.error`."""
    try:
        batch = sources[request.split].load(request.indices, request.draw)
    except HvdtrainError as exc:
        return Loaded(request.indices, None, None, error=str(exc))
    return Loaded(request.indices, batch.x, batch.y, batch.skipped)


class PlanCursor:
    """Which step of which epoch plan a loader's open stream yields next."""

    def __init__(self) -> None:
        self.plan: object = None
        self.next_step = 0

    def follows(self, step: StepIndices) -> bool:
        """Whether the open stream's next micro-batches are ``step``'s."""
        return step.plan is not None and step.plan is self.plan and step.number == self.next_step

    def open(self, step: StepIndices, seed: int) -> list[Request]:
        """The requests of a new stream: ``step`` and the rest of its plan (``step`` alone when
        it has no plan, as when a caller builds one by hand)."""
        if step.plan is None:
            self.plan, self.next_step = None, 0
            return [Request("train", m, Draw(seed, 0)) for m in step.micro]
        self.plan, self.next_step = step.plan, step.number
        draw = Draw(seed, step.plan.epoch)
        return [Request("train", m, draw) for m in step.plan.micro_batches(step.number)]

    def advance(self) -> None:
        """Notes that the stream yielded one more step."""
        self.next_step += 1

    def close(self) -> None:
        """Forgets the stream (an evaluation reused the loader)."""
        self.plan = None


def eval_requests(batches: Iterable[np.ndarray]) -> list[Request]:
    """The requests of an evaluation: the test split's batches, not augmented."""
    return [Request("test", np.asarray(b, dtype=np.int64)) for b in batches]


def check_loaded(loaded: Loaded, expected: np.ndarray) -> None:
    """Raises the worker's data error; guards the promise that a stream yields the plan."""
    if loaded.error:
        raise HvdtrainError(loaded.error)
    if not np.array_equal(loaded.indices, expected):
        raise RuntimeError("the loader yielded other samples than the step's: a bug in hvdtrain")


class SkipReport:
    """Reports each unreadable file that ``skip_corrupt`` replaced, once per process, with the
    count so far; thread-safe (``tf.data`` loads in threads)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.seen: set[str] = set()
        self._lock = threading.Lock()

    def note(self, skipped: Iterable[str]) -> None:
        """Warns about the files of ``skipped`` not reported before."""
        for message in skipped:
            with self._lock:
                if message in self.seen:
                    continue
                self.seen.add(message)
                count = len(self.seen)
            warnings.warn(f"rank {self.rank}: skipped {message} (data.options.skip_corrupt; "
                          f"{count} so far)", stacklevel=2)


def load_direct(sources: dict[str, Source], request: Request, skips: SkipReport) -> Batch:
    """Loads ``request`` on the training thread (sources in memory, or no workers). A data error is
    raised where it happens; the batch is the requested one by construction, so the streams'
    :func:`check_loaded` has nothing to guard here."""
    batch = sources[request.split].load(request.indices, request.draw)
    skips.note(batch.skipped)
    return batch
