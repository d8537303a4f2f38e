"""What travels between workers and servers: raw NumPy buffers and plain integers, never pickles.

A server must not unpickle what a worker sends: a pickled ``torch.__version__`` (a ``str``
subclass) made a prototype server import torch (docs/parameter-servers.md). Every message is
therefore a NumPy buffer sent with mpi4py's upper-case ``Send``/``Isend``, told apart by its tag:

- ``HELLO`` (int64 ``[VERSION, total, chunk, servers, workers, wire]``), once per training, from
  each worker to each server: the layout of the flat gradient (:class:`hvdtrain.ps.layout.Layout`)
  and the dtype chunks travel as (an index into :data:`WIRE_DTYPES`);
- ``CONTROL`` (int64 ``[op, step]``), once per step from each worker to each server: ``PUSH``
  (the step's chunks follow) or ``DONE`` (the training ended; the server returns);
- ``PUSH`` (the wire dtype), one message per chunk the server owns, in ascending chunk order;
- ``PULL`` (the wire dtype), the server's sum of a chunk over all workers, back to each worker.
  A server sums in float32 whatever the wire dtype.

MPI keeps the order of messages with the same source, tag and communicator, so a chunk needs no
header: the n-th ``PUSH`` a server receives from a worker in a step is its n-th owned chunk.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hvdtrain.errors import EnvironmentFailure

VERSION = 1
"""Bumped whenever a message changes: a worker and a server of different versions refuse."""

HELLO, CONTROL, PUSH, PULL = 7101, 7102, 7103, 7104
"""The tags (distinct from anything Horovod sends: it uses its own duplicated communicator)."""

OP_PUSH, OP_DONE = 1, 2
"""The operations of a ``CONTROL`` message."""


WIRE_DTYPES = ("float32", "float16")
"""What chunks travel as: float32, or float16 with ``comm.compression=fp16`` (half the bytes)."""

HELLO_LENGTH = 6


def raw(buffer: np.ndarray) -> np.ndarray:
    """``buffer`` as MPI can carry it: float16 (which MPI has no datatype for) as its bits."""
    return buffer.view(np.uint16) if buffer.dtype == np.float16 else buffer


def hello(total: int, chunk: int, servers: int, workers: int, wire: str) -> np.ndarray:
    """The ``HELLO`` message of a worker."""
    return np.array([VERSION, total, chunk, servers, workers, WIRE_DTYPES.index(wire)], np.int64)


def control(op: int, step: int) -> np.ndarray:
    """A ``CONTROL`` message."""
    return np.array([op, step], np.int64)


class ServerLost(EnvironmentFailure):
    """A server did not answer in time: it died or hangs. The job cannot go on without it; what
    the run saved stays valid (exit code 74: resume after the cause is fixed)."""


def wait(requests: Sequence[tuple[Any, int]], timeout_s: float,
         describe: Any) -> None:
    """Waits for every ``(request, peer)`` to complete, testing rather than blocking so that a
    peer that never answers ends the wait after ``timeout_s`` with :class:`ServerLost`, whose
    message is ``describe(peers)`` for the peers still pending (world ranks, ascending).

    Polls without sleeping for the first millisecond (small messages on one host complete in
    microseconds), then yields the core between polls: a busy wait would take it from a server
    on the same host."""
    pending = list(requests)
    started = time.monotonic()
    pause = 0.0
    while True:
        pending = [(request, peer) for request, peer in pending if not request.Test()]
        if not pending:
            return
        waited = time.monotonic() - started
        if waited > timeout_s:
            raise ServerLost(describe(sorted({peer for _, peer in pending})))
        if waited > 1e-3:
            pause = min(max(pause * 2, 5e-5), 1e-3)
            time.sleep(pause)
