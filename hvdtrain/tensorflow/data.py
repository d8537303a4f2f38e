"""TensorFlow data loading: a ``tf.data`` pipeline over hvdtrain's sampler plan.

A stream is a ``tf.data.Dataset`` of the plan's micro-batch indices, mapped by ``workers``
parallel calls of the source's loader (deterministic: results keep the plan's order) and
prefetched. See :mod:`hvdtrain.data.loading` for why this cannot change which samples a step trains
on. Both frameworks decode with the same framework-free sources, so they train on the same numbers.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import tensorflow as tf

from hvdtrain.data.contracts import Draw, Source
from hvdtrain.data.loading import (Loaded, PlanCursor, Request, SkipReport, check_loaded,
                                   eval_requests, fetch, load_direct)
from hvdtrain.data.sampler import StepIndices
from hvdtrain.errors import HvdtrainError


FIXED = tf.data.Options()
FIXED.autotune.enabled = False
"""The pipeline runs with the parallelism and buffer the config gives (``data.workers``,
``data.prefetch``), without tf.data's autotuning: its optimisation thread held up the release of a
finished epoch's iterator for seconds at the next epoch's first step."""


class TensorFlowLoader:
    """Loads the batches of the sampler's steps and of evaluations as tensors.

    Sources on disk go through ``tf.data`` with ``workers`` parallel calls and ``workers x
    prefetch`` batches ready; with ``workers`` 0, and for sources in memory, batches are gathered
    on the training thread.
    """

    def __init__(self, train: Source, test: Source, *, seed: int, rank: int, workers: int,
                 prefetch: int, input_shape: tuple[int, ...]) -> None:
        self.sources = {"train": train, "test": test}
        self.seed, self.workers, self.prefetch = seed, workers, prefetch
        self.input_shape = input_shape
        self.cursor = PlanCursor()
        self.skips = SkipReport(rank)
        self.errors: list[str] = []
        self._stream: Iterator[tuple[tf.Tensor, tf.Tensor, tf.Tensor]] | None = None

    def _direct(self, split: str) -> bool:
        return self.workers == 0 or self.sources[split].in_memory

    def batches(self, step: StepIndices) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        """The step's micro-batches, in order, as ``(x, y)``."""
        if self._direct("train"):
            draw = Draw(self.seed, step.plan.epoch if step.plan else 0)
            for idx in step.micro:
                yield self._load(Request("train", idx, draw))
            return
        if not self.cursor.follows(step):
            self._stream = self._open(self.cursor.open(step, self.seed))
        self.cursor.advance()  # the stream is now past this step, however far the caller reads
        for idx in step.micro:
            yield self._next(self._stream, idx)

    def eval_batches(self, batches: Iterable[np.ndarray]) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        """The test split's batches, in order, as ``(x, y)``."""
        requests = eval_requests(batches)
        if self._direct("test"):
            for request in requests:
                yield self._load(request)
            return
        stream = self._open(requests)
        for request in requests:
            yield self._next(stream, request.indices)

    def _open(self, requests: list[Request]) -> Iterator[tuple[tf.Tensor, tf.Tensor, tf.Tensor]]:
        """A ``tf.data`` stream of ``requests`` (one split and draw, as a plan's are)."""
        split = requests[0].split if requests else "train"
        draw = requests[0].draw if requests else None
        indices = tf.data.Dataset.from_tensor_slices(padded_indices(requests))

        def load(idx: tf.Tensor) -> tuple[np.ndarray, np.ndarray]:
            loaded = fetch(self.sources, Request(split, idx.numpy(), draw))
            if loaded.error:  # raised again, whole, by the training thread (see _next)
                self.errors.append(loaded.error)
                raise HvdtrainError(loaded.error)
            self.skips.note(loaded.skipped)
            return loaded.x, loaded.y

        def mapped(row: tf.Tensor, length: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
            idx = row[:length]
            x, y = tf.py_function(load, [idx], [tf.float32, tf.int64])
            x.set_shape([None, *self.input_shape])
            y.set_shape([None])
            return idx, x, y

        pipeline = indices.map(mapped, num_parallel_calls=self.workers, deterministic=True)
        return iter(pipeline.prefetch(self.workers * self.prefetch).with_options(FIXED))

    def _next(self, stream: Iterator[tuple[tf.Tensor, tf.Tensor, tf.Tensor]],
              expected: np.ndarray) -> tuple[tf.Tensor, tf.Tensor]:
        try:
            idx, x, y = next(stream)
        except tf.errors.OpError:
            if self.errors:
                raise HvdtrainError(self.errors[0]) from None
            raise
        check_loaded(Loaded(idx.numpy(), None, None), expected)
        return x, y

    def _load(self, request: Request) -> tuple[tf.Tensor, tf.Tensor]:
        """A batch loaded on the training thread."""
        batch = load_direct(self.sources, request, self.skips)
        return tf.convert_to_tensor(batch.x), tf.convert_to_tensor(batch.y)


def padded_indices(requests: list[Request]) -> tuple[np.ndarray, np.ndarray]:
    """The requests' index arrays as one zero-padded matrix and their lengths, the form
    ``tf.data.Dataset.from_tensor_slices`` takes.

    Not ``from_generator``: its Python generator, called from a ``tf.data`` thread for every
    element, slowed the training step that runs beside it (docs/investigations/input-pipeline.md).
    """
    lengths = np.array([len(r.indices) for r in requests], dtype=np.int64)
    padded = np.zeros((len(requests), int(lengths.max(initial=0))), dtype=np.int64)
    for row, request in enumerate(requests):
        padded[row, :len(request.indices)] = request.indices
    return padded, lengths
