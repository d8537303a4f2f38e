"""The ``ps`` gradient exchange, framework-free: the flat gradient pushed to the servers, its sum
pulled back and divided by the number of workers.

That is the ring's average: Horovod's ``Average`` sums, then multiplies by ``1 / size`` in double
precision, and so does :meth:`PSExchange.run`; with ``bsp`` the workers step their own optimizers
with it, so a ``ps`` run trains as a ``ring`` run of the same workers. A framework supplies the
conversions between its gradients and one flat float32 NumPy vector, and its Horovod ``any_rank``
(:mod:`hvdtrain.torch.ps`, :mod:`hvdtrain.tensorflow.ps`).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hvdtrain.config import PSConfig
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import GradientExchange, empty_stats
from hvdtrain.ps.client import PSClient
from hvdtrain.ps.layout import chunk_elements
from hvdtrain.ps.world import split

WIRES = {"none": "float32", "fp16": "float16"}
"""The dtype chunks travel as, by ``comm.compression`` (the two that ``ps`` takes)."""


def ps_stats(client: PSClient, comm_s: float, convert_s: float) -> dict[str, float]:
    """A step's measurements: the ring's keys (``wire_bytes`` and ``dense_bytes``, the float32
    bytes they stand for, count both directions) and the bytes per direction, ``push_bytes`` and
    ``pull_bytes``."""
    wire = float(client.pushed_bytes + client.pulled_bytes)
    dense = 2.0 * 4 * client.layout.total
    return {**empty_stats(), "wire_bytes": wire, "dense_bytes": dense, "comm_s": comm_s,
            "compress_s": convert_s, "push_bytes": float(client.pushed_bytes),
            "pull_bytes": float(client.pulled_bytes)}


class PSExchange(GradientExchange):
    """Dedicated parameter servers summing the gradients (``ps.consistency=bsp``)."""

    def __init__(self, client: PSClient, rank: int, size: int,
                 shapes: Sequence[Sequence[int]]) -> None:
        self.client, self.rank, self.size = client, rank, size
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.stats = empty_stats()

    def run(self, grads: Sequence[Any]) -> list[Any]:
        started = time.perf_counter()
        flat = self.flatten(grads)
        sent = time.perf_counter()
        summed = self.client.push_pull(flat)
        pulled = time.perf_counter()
        # As Horovod's Average: the sum times 1 / size, computed in double, rounded to float32
        # (the sum arrives in the wire dtype: float16 under fp16, as Horovod's fp16 sends it).
        mean = (summed.astype(np.float64) * (1.0 / self.size)).astype(np.float32)
        out = self.unflatten(mean)
        convert = (sent - started) + (time.perf_counter() - pulled)
        self.stats = ps_stats(self.client, pulled - sent, convert)
        return out

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """``flat`` cut into the gradients' shapes (views)."""
        bounds = np.cumsum([0, *self.sizes])
        return [flat[a:b].reshape(shape)
                for a, b, shape in zip(bounds[:-1], bounds[1:], self.shapes, strict=True)]

    @abc.abstractmethod
    def flatten(self, grads: Sequence[Any]) -> np.ndarray:
        """The gradients as one contiguous float32 vector, in model order."""

    @abc.abstractmethod
    def unflatten(self, flat: np.ndarray) -> list[Any]:
        """``flat`` as the framework's gradients, in the shapes given."""

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        if (rank, size) != (self.rank, self.size):
            raise HvdtrainError("comm.topology=ps cannot change its number of workers")

    def finish(self) -> None:
        """Tells the servers this training ended (the driver calls it on every worker)."""
        self.client.finish()


def make_client(ps: PSConfig, compression: str, shapes: Sequence[Sequence[int]]) -> PSClient:
    """The worker's client for gradients of these shapes, sent as ``comm.compression`` says
    (``none`` or ``fp16``); starts the training on the servers."""
    total = sum(int(np.prod(s)) for s in shapes)
    return PSClient(split(ps.servers), total, chunk_elements(ps.chunk_kib), ps.timeout_s,
                    WIRES[compression])
