"""TensorFlow data loading: a ``tf.data`` pipeline over hvdtrain's sampler plan.

A stream is a ``tf.data.Dataset`` of the plan's micro-batch indices, mapped by ``workers``
parallel calls of the source's loader (deterministic: results keep the plan's order) and
prefetched. See :mod:`hvdtrain.data.loading` for why this cannot change which samples a step trains
on. Both frameworks decode with the same framework-free sources, so they train on the same numbers.

Batches are ``(inputs, targets)``, trees of tensors (:mod:`hvdtrain.data.tree`) of the structure,
dtypes and shapes the dataset's :class:`~hvdtrain.data.contracts.DatasetSpec` declares; the engine
traces its step for them with :func:`batch_signature`. A loaded batch that does not fit the spec
stops the run naming the array, before TensorFlow would refuse it less clearly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from hvdtrain.data import tree
from hvdtrain.data.contracts import ArraySpec, Batch, DatasetSpec, Draw, Source
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

FIXED = tf.data.Options()
FIXED.autotune.enabled = False
"""The pipeline runs with the parallelism and buffer the config gives (``data.workers``,
``data.prefetch``), without tf.data's autotuning: its optimisation thread held up the release of a
finished epoch's iterator for seconds at the next epoch's first step."""

Pair = tuple[Any, Any]
"""A batch as the engine takes it: ``(inputs, targets)``, trees of tensors (targets may be None)."""
Element = tuple[tf.Tensor, Any, Any]
"""What a stream yields: the batch's sample indices, its inputs and its targets."""


def _tensor_spec(spec: ArraySpec) -> tf.TensorSpec:
    return tf.TensorSpec([None, *spec.shape], tf.as_dtype(spec.dtype))


def batch_signature(spec: DatasetSpec) -> tuple[Any, Any]:
    """The ``tf.function`` input signature of a batch's ``(inputs, targets)`` for data of ``spec``:
    trees of ``tf.TensorSpec`` with the batch dimension unknown (one trace serves short and empty
    micro-batches); no targets is a ``tf.NoneTensorSpec`` (a signature cannot hold None)."""
    inputs = tree.map_tree(_tensor_spec, spec.inputs)
    if spec.targets is None:
        return inputs, tf.NoneTensorSpec()
    return inputs, tree.map_tree(_tensor_spec, spec.targets)


class TensorFlowLoader:
    """Loads the batches of the sampler's steps and of evaluations as tensors.

    Sources on disk go through ``tf.data`` with ``workers`` parallel calls and ``workers x
    prefetch`` batches ready; with ``workers`` 0, and for sources in memory, batches are gathered
    on the training thread.
    """

    def __init__(self, train: Source, test: Source, *, seed: int, rank: int, workers: int,
                 prefetch: int, spec: DatasetSpec) -> None:
        self.sources = {"train": train, "test": test}
        self.seed, self.workers, self.prefetch = seed, workers, prefetch
        self.spec = spec
        self.cursor = PlanCursor()
        self.skips = SkipReport(rank)
        self.errors: list[str] = []
        self._stream: Iterator[Element] | None = None

    def _direct(self, split: str) -> bool:
        return self.workers == 0 or self.sources[split].in_memory

    def batches(self, step: StepIndices) -> Iterator[Pair]:
        """The step's micro-batches, in order, as ``(inputs, targets)``."""
        if self._direct("train"):
            draw = Draw(self.seed, step.plan.epoch if step.plan else 0)
            for idx in step.micro:
                yield self._load(Request("train", idx, draw))
            return
        stream = self._stream
        if stream is None or not self.cursor.follows(step):  # None: no stream was opened yet
            stream = self._stream = self._open(self.cursor.open(step, self.seed))
        self.cursor.advance()  # the stream is now past this step, however far the caller reads
        for idx in step.micro:
            yield self._next(stream, idx)

    def eval_batches(self, batches: Iterable[np.ndarray]) -> Iterator[Pair]:
        """The test split's batches, in order, as ``(inputs, targets)``."""
        requests = eval_requests(batches)
        if self._direct("test"):
            for request in requests:
                yield self._load(request)
            return
        stream = self._open(requests)
        for request in requests:
            yield self._next(stream, request.indices)

    def _open(self, requests: list[Request]) -> Iterator[Element]:
        """A ``tf.data`` stream of ``requests`` (one split and draw, as a plan's are)."""
        split = requests[0].split if requests else "train"
        draw = requests[0].draw if requests else None
        indices = tf.data.Dataset.from_tensor_slices(padded_indices(requests))
        structure = (self.spec.inputs, self.spec.targets)
        specs = tree.leaves(structure)

        def load(idx: tf.Tensor) -> list[np.ndarray]:
            loaded = fetch(self.sources, Request(split, idx.numpy(), draw))
            try:
                if loaded.error:
                    raise HvdtrainError(loaded.error)
                self._check(Batch(loaded.x, loaded.y), len(loaded.indices), split)
            except HvdtrainError as exc:  # raised again, whole, by the training thread (see _next)
                self.errors.append(str(exc))
                raise
            self.skips.note(loaded.skipped)
            return tree.leaves((loaded.x, loaded.y))

        def mapped(row: tf.Tensor, length: tf.Tensor) -> Element:
            idx = row[:length]
            flat = tf.py_function(load, [idx], [tf.as_dtype(s.dtype) for s in specs])
            for tensor, spec in zip(flat, specs, strict=True):
                tensor.set_shape([None, *spec.shape])
            x, y = tree.unflatten(structure, flat)
            return idx, x, y

        pipeline = indices.map(mapped, num_parallel_calls=self.workers, deterministic=True)
        return iter(pipeline.prefetch(self.workers * self.prefetch).with_options(FIXED))

    def _check(self, batch: Batch, size: int, split: str) -> None:
        """Raises when ``batch`` does not fit the spec the step was traced for."""
        self.spec.check(batch, size, f"a batch of the {split} split")

    def _next(self, stream: Iterator[Element], expected: np.ndarray) -> Pair:
        try:
            idx, x, y = next(stream)
        except tf.errors.OpError:
            if self.errors:
                raise HvdtrainError(self.errors[0]) from None
            raise
        check_loaded(Loaded(idx.numpy(), None, None), expected)
        return x, y

    def _load(self, request: Request) -> Pair:
        """A batch loaded on the training thread."""
        batch = load_direct(self.sources, request, self.skips)
        self._check(batch, len(request.indices), request.split)
        return (tree.map_tree(tf.convert_to_tensor, batch.x),
                tree.map_tree(tf.convert_to_tensor, batch.y))


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
