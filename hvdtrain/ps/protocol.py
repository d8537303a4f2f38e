"""What travels between workers and servers: raw NumPy buffers and plain integers, never pickles.

A server must not unpickle what a worker sends: a pickled ``torch.__version__`` (a ``str``
subclass) made a prototype server import torch (docs/parameter-servers.md). Every message is
therefore a NumPy buffer sent with mpi4py's upper-case ``Send``/``Isend``, told apart by its tag:

- ``HELLO`` (int64 ``[VERSION, total, chunk, servers, workers, wire, consistency, staleness,
  method, ratio, error_feedback, bucket, min_size, seed]``), once per training, from each worker
  to each server: the layout of the flat gradient (:class:`hvdtrain.ps.layout.ChunkLayout`), the dtype
  dense chunks travel as (an index into :data:`WIRE_DTYPES`), the ``ps.consistency`` (an index
  into :data:`CONSISTENCIES`) with its ``ps.staleness``, and the compression settings
  (:class:`hvdtrain.ps.codec.WireSettings`: the method an index into
  :data:`hvdtrain.ps.codec.METHODS`, the ratio as float64 bits);
- ``CONTROL`` (int64 ``[op, step, version, lr]``), once per step from each worker to each server:
  ``PUSH`` (the step's chunks follow) or ``DONE`` (the training ended; the server returns); also
  ``STATE`` (before a checkpoint: send the shard's state back to worker 0; under ``bsp`` every
  worker asks, so that the servers see one operation a step) and, under ``bsp``, ``LOAD``
  (resumed: worker 0 sends the shard's state, tag ``INIT``). ``step`` counts the workers' steps
  across resumptions (it seeds random draws); ``version`` is the server version the pushed
  gradient was computed on and ``lr`` the learning rate to apply it with (float64 bits), both 0
  under ``bsp``;
- ``PUSH``, per chunk the server owns, in descending chunk order under ``bsp`` (the order a
  backward pass produces a sequential model's gradients in: the last layers' first) and ascending
  under ``ssp``/``asp``, the buffers of the chunk's codec
  (:mod:`hvdtrain.ps.codec`: one in the wire dtype when dense; values and int32 indices, or int8
  codes and float32 scales, when compressed);
- ``PULL``: under ``bsp`` the server's sum of a chunk over all workers as the pull's codec
  encodes it (a server decodes and sums in float32 whatever travels), back to each worker; under
  ``ssp``/``asp`` the chunk's current parameters (always float32: parameters rounded to float16
  would lose the updates);
- ``INIT`` (``ssp``/``asp``, once, from worker 0 to each server before any push): float64
  ``[optimizer, momentum, weight_decay, beta1, beta2, eps]`` (the ``optim`` section, optimizer an
  index into :data:`hvdtrain.ps.optim.OPTIMIZERS`), int64 ``[steps, arrays]`` and one float32
  buffer: the shard's parameters then ``arrays`` optimizer state vectors (a resumed run's);
- ``VERSIONS`` (int64 ``[version, staleness]``), before each ``PULL`` under ``ssp``/``asp``: the
  version of the parameters that follow and the staleness the worker's push saw;
- ``STATE``: the answer to a ``STATE`` control, int64 ``[version, steps, arrays]`` and a float32
  buffer laid out as ``INIT``'s; under ``bsp`` the shard's pull residuals (float32), only where
  the servers keep them (:attr:`hvdtrain.ps.codec.WireSettings.server_feedback`);
- ``ROWS``, between workers under ``bsp`` with compression: the step and each worker's push
  residuals, to worker 0 before a checkpoint and from worker 0 when resumed.

MPI keeps the order of messages with the same source, tag and communicator, so a chunk needs no
header: the n-th ``PUSH`` a server receives from a worker in a step is its n-th owned chunk in
that order, and so is the n-th ``PULL`` a worker receives from a server.

Nothing received is trusted (:class:`Receive`): a message is matched by a probe and taken only when
its size is exactly the one expected, before a byte of it lands (a short message would leave
garbage in the buffer; a long one Open MPI 4.1 may crash on while truncating), and its fields are
checked against their ranges before use (:func:`check`). A peer that breaks the protocol gets a
:class:`ProtocolError` naming its rank and the field, and nothing is allocated by a size it sent:
a server sizes its buffers from ``HELLO`` only after bounding it (:data:`MAX_CHUNKS`,
:func:`available_bytes`).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from hvdtrain.errors import EnvironmentFailure, HvdtrainError

VERSION = 5
"""Bumped whenever a message changes: a worker and a server of different versions refuse."""

HELLO, CONTROL, PUSH, PULL = 7101, 7102, 7103, 7104
INIT, VERSIONS, STATE, ROWS = 7105, 7106, 7107, 7108
"""The tags (distinct from anything Horovod sends: it uses its own duplicated communicator)."""

OP_PUSH, OP_DONE, OP_STATE, OP_LOAD = 1, 2, 3, 4
"""The operations of a ``CONTROL`` message."""

OPERATIONS = {OP_PUSH: "PUSH", OP_DONE: "DONE", OP_STATE: "STATE", OP_LOAD: "LOAD"}
"""Every operation's name; ``ssp``/``asp`` servers know all but ``LOAD``."""

CONSISTENCIES = ("bsp", "ssp", "asp")
"""``ps.consistency`` values, by their index in ``HELLO``."""

CONTROL_LENGTH = 4
HYPER_LENGTH = 6


WIRE_DTYPES = ("float32", "float16")
"""What chunks travel as: float32, or float16 with ``comm.compression=fp16`` (half the bytes)."""

HELLO_FIELDS = ("version", "total", "chunk", "servers", "workers", "wire", "consistency",
                "staleness", "method", "ratio", "error_feedback", "bucket", "min_size", "seed")
"""The names of ``HELLO``'s fields, in order (error messages name them)."""

HELLO_LENGTH = len(HELLO_FIELDS)

MAX_CHUNKS = 1 << 20
"""The most chunks a flat vector may be cut into: a server lays out every chunk (a Python loop) and
receives one message per chunk and worker a step, so a ``HELLO`` past this is refused before
anything is laid out. Workers refuse a ``ps.chunk_kib`` that would reach it
(:class:`hvdtrain.ps.client.PSClient`): a million chunks of the smallest, 1 KiB, are 256 Mi
elements."""

PUSH_WINDOW = 2
"""A worker's chunk pushes in flight at once, in chunk order: the first chunks reach their
servers early, so their sums travel back while later chunks still go out; two rather than one
so that the link does not idle while the next push is posted."""


def raw(buffer: np.ndarray) -> np.ndarray:
    """``buffer`` as MPI can carry it: float16 (which MPI has no datatype for) as its bits."""
    return buffer.view(np.uint16) if buffer.dtype == np.float16 else buffer


def hello(total: int, chunk: int, servers: int, workers: int, wire: str,
          consistency: str = "bsp", staleness: int = 0,
          settings: Sequence[int] = (0, 0, 0, 0, 0, 0)) -> np.ndarray:
    """The ``HELLO`` message of a worker (``settings``: the compression's, as
    :meth:`hvdtrain.ps.codec.WireSettings.to_ints` gives them)."""
    return np.array([VERSION, total, chunk, servers, workers, WIRE_DTYPES.index(wire),
                     CONSISTENCIES.index(consistency), staleness, *settings], np.int64)


def control(op: int, step: int, version: int = 0, lr: float = 0.0) -> np.ndarray:
    """A ``CONTROL`` message (``lr`` travels as the bits of a float64)."""
    return np.array([op, step, version, np.float64(lr).view(np.int64)], np.int64)


def control_lr(message: np.ndarray) -> float:
    """The learning rate of a ``CONTROL`` message."""
    return float(message[3:4].view(np.float64)[0])


class ProtocolError(HvdtrainError):
    """A peer sent what the protocol does not allow: a message of the wrong size, a field out of
    its range, an unknown operation, or what the other workers contradict. The message names the
    peer and the field, on one line."""


def peer_name(world: Any, rank: int) -> str:
    """``parameter server 0 (rank 2 on host node3)`` or ``worker 1 (rank 1 on host node1)``."""
    prefix = "parameter " if rank in world.servers else ""
    return prefix + world.name(rank)


def refused(world: Any, rank: int, what: str) -> ProtocolError:
    """The error for a message of ``rank`` that breaks the protocol: ``what`` it sent and why."""
    return ProtocolError(f"{peer_name(world, rank)} sent {what}")


def check(ok: bool, world: Any, rank: int, field: str, value: Any, rule: str) -> None:
    """Raises :func:`refused` (``<field>=<value>: <rule>``) unless ``ok``."""
    if not ok:
        raise refused(world, rank, f"{field}={value}: {rule}")


def in_range(world: Any, rank: int, field: str, value: int, choices: Sequence[Any]) -> None:
    """Refuses ``value`` unless it indexes ``choices`` (a negative index must not wrap)."""
    check(0 <= value < len(choices), world, rank, field, value,
          f"must be 0 .. {len(choices) - 1} ({', '.join(map(str, choices))})")


def float_field(world: Any, rank: int, field: str, value: float, low: float = 0.0,
                high: float = math.inf, high_open: bool = False) -> None:
    """Refuses ``value`` unless finite and in [``low``, ``high``] (or [``low``, ``high``))."""
    above = value < high if high_open else value <= high
    check(math.isfinite(value) and low <= value and above, world, rank, field, value,
          f"must be finite and in [{low:g}, {high:g}{')' if high_open else ']'}")


class Mailbox:
    """The receives waiting for messages of one peer and tag on one communicator, in the order
    they were posted: a message is matched by a probe (``MPI_Improbe``) and handed to the oldest
    waiting :class:`Receive`, which checks its size before it takes it. MPI keeps the order of
    one peer's messages of one tag, so receives posted in order get the messages in order, as
    with ``Irecv``."""

    def __init__(self, comm: Any, peer: int, tag: int) -> None:
        from mpi4py import MPI  # already started by hvdtrain.ps.mpi's split

        self.comm, self.peer, self.tag = comm, peer, tag
        self.status, self.byte = MPI.Status(), MPI.BYTE
        self.waiting: deque[Receive] = deque()
        self.lock = threading.Lock()  # a worker's push thread and its main thread both receive

    def match(self) -> None:
        """Hands every message that has arrived to the receives waiting, oldest first."""
        with self.lock:
            while self.waiting:
                message = self.comm.Improbe(self.peer, self.tag, self.status)
                if message is None:
                    return
                self.waiting.popleft().take(message, self.status.Get_count(self.byte))


_MAILBOXES: dict[tuple[int, int, int], Mailbox] = {}
"""By (communicator, peer, tag); a mailbox keeps its communicator alive, so ids are not reused."""


def mailbox(comm: Any, peer: int, tag: int) -> Mailbox:
    """The :class:`Mailbox` of ``peer`` and ``tag`` on ``comm``."""
    key = (id(comm), peer, tag)
    if key not in _MAILBOXES:
        _MAILBOXES[key] = Mailbox(comm, peer, tag)
    return _MAILBOXES[key]


class Receive:
    """A receive into ``buffer`` of one message from ``peer`` with ``tag`` (posted at once, like
    ``Irecv``; :meth:`Test` as a request's): a message of any other size than ``buffer``'s bytes
    (or one of ``sizes``) is refused, unread, with a :class:`ProtocolError` naming the peer and
    ``field``. :attr:`count` is the bytes received."""

    def __init__(self, world: Any, buffer: np.ndarray, peer: int, tag: int, field: str,
                 sizes: Sequence[int] = ()) -> None:
        self.world, self.buffer, self.peer, self.field = world, raw(buffer), peer, field
        self.sizes = tuple(sizes) or (self.buffer.nbytes,)
        self.request: Any = None
        self.count = -1
        self.box = mailbox(world.comm, peer, tag)
        with self.box.lock:
            self.box.waiting.append(self)

    def take(self, message: Any, count: int) -> None:
        """Receives ``message`` (``count`` bytes) if it has an expected size; else refuses it."""
        if count not in self.sizes:
            expected = " or ".join(map(str, self.sizes))
            raise refused(self.world, self.peer, f"{self.field} of {count} bytes where {expected} "
                                                 "belong")
        self.count = count
        self.request = message.Irecv(self.buffer)

    def Test(self) -> bool:  # a request's name: wait() tests requests and these alike
        """Whether the message has arrived whole (raises if it has the wrong size)."""
        if self.request is None:
            if self.box.waiting and self.box.waiting[0] is self:
                self.box.match()  # only the oldest probes: a later one cannot take first
            if self.request is None:
                return False
        return bool(self.request.Test())


def receive(world: Any, buffer: np.ndarray, peer: int, tag: int, field: str) -> np.ndarray:
    """Receives one message into ``buffer`` (:class:`Receive`), waiting as a server waits
    (:func:`waitall`: no time limit); returns ``buffer``."""
    waitall([Receive(world, buffer, peer, tag, field)])
    return buffer


def available_bytes() -> int | None:
    """Memory this machine can still give (``MemAvailable``), or None where it cannot say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


class ServerLost(EnvironmentFailure):
    """A server did not answer in time: it died or hangs. The job cannot go on without it; what
    the run saved stays valid (exit code 74: resume after the cause is fixed)."""


NOT_READY = None
"""What a worker's pushes yield (:func:`wait`'s ``batches``) while the next chunk is still being
computed: the backward pass has not written it yet (:meth:`hvdtrain.ps.client.PSClient.begin`)."""


def wait(requests: Sequence[tuple[Any, int]], timeout_s: float, describe: Any,
         batches: Iterable[list[tuple[Any, int]] | None] = (), window: int = 0) -> None:
    """Waits for every ``(request, peer)`` to complete, testing rather than blocking so that a
    peer that never answers ends the wait after ``timeout_s`` with :class:`ServerLost`, whose
    message is ``describe(peers)`` for the peers still pending (world ranks, ascending).

    ``batches`` (a worker's pushes, one list of requests a chunk, posted as the iterator is
    advanced) are kept at most ``window`` in flight: the next is posted when one completes. Sent
    all at once, every chunk would share the link and each finish only at the end of the whole
    push, so that no server could sum and answer a chunk before then (:data:`PUSH_WINDOW`). A
    batch of :data:`NOT_READY` means the next chunk is not computed yet: the wait polls on and
    asks again. The time limit counts from the last push posted (or waited for), so that the
    worker's own backward pass is not counted against the servers.

    Polls without sleeping for the first millisecond (small messages on one host complete in
    microseconds), then yields the core between polls: a busy wait would take it from a server
    on the same host."""
    pending = list(requests)
    waiting = iter(batches)
    flight: list[list[tuple[Any, int]]] = []
    began = since = time.monotonic()  # the wait's start; the time limit's
    pause, exhausted = 0.0, False
    while True:
        flight = [left for left in ([(r, p) for r, p in batch if not r.Test()] for batch in flight)
                  if left]
        while not exhausted and len(flight) < max(1, window):
            batch = next(waiting, _END)
            if batch is _END:
                exhausted = True
            else:
                since = time.monotonic()
                if batch is NOT_READY:
                    break
                flight.append(batch)
        pending = [(request, peer) for request, peer in pending if not request.Test()]
        if exhausted and not pending and not flight:
            return
        now = time.monotonic()
        if now - since > timeout_s:
            late = [peer for _, peer in pending] + [peer for batch in flight for _, peer in batch]
            raise ServerLost(describe(sorted(set(late))))
        pause = yield_core(now - began, pause)


_END: Any = object()


def waitall(requests: Sequence[Any]) -> None:
    """A server's wait for ``requests``, with no time limit (workers may compute, evaluate or
    checkpoint for as long as they need between steps), polling as :func:`wait` does: Open MPI's
    blocking wait spins (``sched_yield`` under ``mpi_yield_when_idle``) and takes a core from the
    workers beside it."""
    wait([(request, -1) for request in requests], math.inf, str)


def yield_core(waited: float, pause: float) -> float:
    """Between two polls of a wait that began ``waited`` seconds ago: nothing for the first
    millisecond (small messages on one host complete in microseconds), then a sleep that doubles
    up to 1 ms; returns the pause to pass next time."""
    if waited <= 1e-3:
        return pause
    pause = min(max(pause * 2, 5e-5), 1e-3)
    time.sleep(pause)
    return pause
