"""The server loop: NumPy and mpi4py only, never a framework or Horovod (a test checks).

One :func:`serve` call serves one training: the workers' ``HELLO`` gives the layout, then every
step each worker pushes the chunks this server owns, and the server returns each chunk's sum over
the workers as soon as all of that chunk has arrived (BytePS's summation service: the workers keep
their optimizers). Chunks are received and sent without blocking, so the pull of one chunk
overlaps the push of the next. The sum runs in worker order, the same on every step, so every
worker gets the same bits. That is ``ps.consistency=bsp``; under ``ssp`` and ``asp`` the server
runs the optimizer itself, one push at a time (:mod:`hvdtrain.ps.async_server`).
"""

from __future__ import annotations

import itertools
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from hvdtrain.ps import protocol
from hvdtrain.ps.codec import METHODS, SPARSE, WireSettings, encode, pull_scheme, push_scheme
from hvdtrain.ps.layout import ChunkLayout
from hvdtrain.ps.mpi import PSWorld
from hvdtrain.ps.protocol import ProtocolError, check, in_range, refused

__all__ = ["ProtocolError", "Shard", "read_controls", "read_hello", "run_server", "serve",
           "sum_step"]

INDEX_LIMIT = 2**31 - 1
"""The largest chunk a sparse method may send: its indices within a chunk travel as int32."""

BYTES_PER_ELEMENT = 8
"""A bound on the bytes per element of a server's shard for each worker (its receive buffers,
and under ``ssp``/``asp`` its answers), beside :data:`SHARD_BYTES` for the shard itself."""

SHARD_BYTES = 32
"""A bound on the bytes per element of a server's own vectors: sums, residuals and the pull's
encoding (``bsp``), or parameters, two optimizer moments and ``INIT``'s buffer (``ssp``/``asp``)."""


class Shard:
    """This server's chunks of the flat gradient: the receive buffers per worker and chunk (its
    push codec's), the chunk sums (float32), and under ``topk`` with error feedback what the
    pulls left unsent (one vector in the shard's layout, :mod:`hvdtrain.ps.shards`, with a view
    per chunk)."""

    def __init__(self, layout: ChunkLayout, server: int, workers: int,
                 settings: WireSettings | None = None) -> None:
        settings = settings or WireSettings()
        self.chunks = layout.owned(server)
        self.sizes = [stop - start for start, stop in map(layout.bounds, self.chunks)]
        push, pull = push_scheme(settings), pull_scheme(settings)
        self.pushes = [push.codec(n) for n in self.sizes]
        self.pulls = [pull.codec(n) for n in self.sizes]
        self.received = [[codec.buffers(n) for codec, n in zip(self.pushes, self.sizes, strict=True)]
                         for _ in range(workers)]
        self.sums = [np.empty(n, np.float32) for n in self.sizes]
        self.residual = (np.zeros(self.elements, np.float32) if settings.server_feedback
                         else None)
        offsets = np.cumsum([0, *self.sizes]).tolist()
        self.residuals = [None if self.residual is None else self.residual[a:b]
                          for a, b in itertools.pairwise(offsets)]

    @property
    def elements(self) -> int:
        """Elements this server sums per step."""
        return sum(self.sizes)

    def check(self, i: int, world: PSWorld) -> None:
        """Refuses chunk ``i``'s pushes where they hold what no worker encodes (an index out of
        the chunk, which :meth:`add` would wrap), naming the worker."""
        codec, n = self.pushes[i], self.sizes[i]
        for rank, received in zip(world.worker_ranks, self.received, strict=True):
            problem = codec.problem(received[i], n)
            if problem:
                raise refused(world, rank, f"PUSH of chunk {self.chunks[i]} with {problem}")

    def add(self, i: int) -> None:
        """Chunk ``i``'s sum over the workers' decoded pushes, in worker order."""
        total, codec, n = self.sums[i], self.pushes[i], self.sizes[i]
        np.copyto(total, codec.decode(self.received[0][i], n))
        for received in self.received[1:]:
            total += codec.decode(received[i], n)

    def answer(self, i: int, step: int, rank: int) -> list[np.ndarray]:
        """The buffers of chunk ``i``'s pull: its sum (plus what earlier pulls left unsent) as
        the pull codec encodes it."""
        return encode(self.pulls[i], self.sums[i], self.residuals[i], step, self.chunks[i], rank)


def read_hello(world: PSWorld) -> tuple[ChunkLayout, str, str, int, WireSettings]:
    """The layout, wire dtype, consistency, staleness bound and compression settings every worker
    announced; each ``HELLO`` is checked field by field, then they must agree with each other and
    with this server, and the shard they ask for must fit this machine's memory."""
    ranks = world.worker_ranks
    messages = np.zeros((len(ranks), protocol.HELLO_LENGTH), np.int64)
    for i, rank in enumerate(ranks):
        check_hello(world, rank, protocol.receive(world, messages[i], rank, protocol.HELLO,
                                                  "HELLO"))
    for i, rank in enumerate(ranks[1:], start=1):
        differ = np.flatnonzero(messages[i] != messages[0])
        if differ.size:
            field = protocol.HELLO_FIELDS[int(differ[0])]
            raise refused(world, rank, f"HELLO's {field}={int(messages[i][differ[0]])} where "
                                       f"{world.name(ranks[0])} sent {int(messages[0][differ[0]])}: "
                                       "the workers must agree")
    total, chunk, servers = (int(v) for v in messages[0, 1:4])
    wire, consistency, staleness = (int(v) for v in messages[0, 5:8])
    layout = ChunkLayout(total, chunk, servers)
    check_memory(world, layout)
    return (layout, protocol.WIRE_DTYPES[wire], protocol.CONSISTENCIES[consistency], staleness,
            WireSettings.from_ints(messages[0, 8:].tolist()))


def check_hello(world: PSWorld, rank: int, message: np.ndarray) -> None:
    """Refuses a ``HELLO`` of ``rank`` with a field out of its range, naming the field."""
    fields = dict(zip(protocol.HELLO_FIELDS, (int(v) for v in message), strict=True))

    def at_least(name: str, low: int) -> None:
        check(fields[name] >= low, world, rank, f"HELLO's {name}", fields[name], f"must be >= {low}")

    version = fields["version"]
    check(version == protocol.VERSION, world, rank, "HELLO's version", version,
          f"this server speaks protocol {protocol.VERSION}")
    for name, actual in (("servers", len(world.servers)), ("workers", len(world.worker_ranks))):
        check(fields[name] == actual, world, rank, f"HELLO's {name}", fields[name],
              f"the job has {actual}")
    at_least("total", 0)
    at_least("chunk", 1)
    in_range(world, rank, "HELLO's wire", fields["wire"], protocol.WIRE_DTYPES)
    in_range(world, rank, "HELLO's consistency", fields["consistency"], protocol.CONSISTENCIES)
    at_least("staleness", 0)
    in_range(world, rank, "HELLO's method", fields["method"], METHODS)
    check(fields["error_feedback"] in (0, 1), world, rank, "HELLO's error_feedback",
          fields["error_feedback"], "must be 0 or 1")
    for name in ("bucket", "min_size", "seed"):
        at_least(name, 0)
    if METHODS[fields["method"]] in SPARSE:
        ratio = float(message[protocol.HELLO_FIELDS.index("ratio"):][:1].view(np.float64)[0])
        protocol.float_field(world, rank, "HELLO's ratio", ratio, high=1.0)
        check(ratio > 0, world, rank, "HELLO's ratio", ratio, "must be > 0")
        check(fields["chunk"] <= INDEX_LIMIT, world, rank, "HELLO's chunk", fields["chunk"],
              f"must be <= {INDEX_LIMIT} (indices travel as int32)")
    count = -(-fields["total"] // fields["chunk"])
    check(count <= protocol.MAX_CHUNKS, world, rank, "HELLO's total", fields["total"],
          f"{count} chunks of {fields['chunk']} elements, more than the "
          f"{protocol.MAX_CHUNKS} a server lays out")


def check_memory(world: PSWorld, layout: ChunkLayout) -> None:
    """Refuses a layout whose shard would need more memory than this machine has available,
    before anything is allocated for it (naming the workers' ``total``)."""
    available = protocol.available_bytes()
    elements = layout.elements(world.server_index)
    needed = elements * (BYTES_PER_ELEMENT * len(world.worker_ranks) + SHARD_BYTES)
    if available is not None and needed > available:
        raise refused(world, world.worker_ranks[0],
                      f"HELLO's total={layout.total} (as every worker did): this server's shard "
                      f"of {elements} elements needs up to {needed / 2**30:.1f} GiB, the machine "
                      f"has {available / 2**30:.1f} GiB available")


def read_controls(world: PSWorld, step: int | None) -> tuple[int, int]:
    """The operation all workers asked for and the step they are at: ``OP_PUSH``, ``OP_DONE``,
    ``OP_STATE`` or ``OP_LOAD``. ``step``: the step they must be at (None before the first
    control: a resumed run goes on from its checkpoint's step)."""
    ranks = world.worker_ranks
    messages = np.zeros((len(ranks), protocol.CONTROL_LENGTH), np.int64)
    protocol.waitall([protocol.Receive(world, messages[i], r, protocol.CONTROL, "CONTROL")
                      for i, r in enumerate(ranks)])
    for rank, (op, at) in zip(ranks, messages[:, :2].tolist(), strict=True):
        check(op in protocol.OPERATIONS, world, rank, "CONTROL's operation", op,
              f"unknown (known: {', '.join(f'{k} {v}' for k, v in protocol.OPERATIONS.items())})")
        check(at >= 0, world, rank, "CONTROL's step", at, "must be >= 0")
    first_op, first_step = messages[0, :2].tolist()
    for rank, (op, at) in zip(ranks, messages[:, :2].tolist(), strict=True):
        check(op == first_op, world, rank, "CONTROL's operation", op,
              f"{world.name(ranks[0])} asked for {first_op} in the same step: the workers must "
              "agree")
        check(at == (first_step if step is None else step), world, rank, "CONTROL's step", at,
              f"the workers are at step {first_step if step is None else step}")
    return int(first_op), int(first_step)


def sum_step(world: PSWorld, shard: Shard, step: int = 0) -> None:
    """Receives one step's chunks from every worker and sends each chunk's sum back, both in
    descending chunk order (the order the workers push in: :mod:`hvdtrain.ps.protocol`)."""
    comm, ranks = world.comm, world.worker_ranks
    order = range(len(shard.sums) - 1, -1, -1)
    arriving = {i: [protocol.Receive(world, b, r, protocol.PUSH, f"PUSH of chunk {shard.chunks[i]}")
                    for w, r in enumerate(ranks) for b in shard.received[w][i]]
                for i in order}
    leaving, in_flight = [], []
    for i in order:
        protocol.waitall(arriving[i])
        shard.check(i, world)
        shard.add(i)
        # qsgd's pull noise is drawn as for a rank after the last worker's: whichever server
        # owns the chunk, so that a run resumed on another number of servers draws the same.
        sent = shard.answer(i, step, len(ranks))
        in_flight.append(sent)  # alive until the sends complete
        leaving += [comm.Isend(protocol.raw(b), dest=r, tag=protocol.PULL)
                    for r in ranks for b in sent]
    protocol.waitall(leaving)


def serve(world: PSWorld) -> int:
    """Serves one training until its workers say ``DONE``; returns the steps served (under
    ``ssp``/``asp``: the pushes applied)."""
    layout, wire, consistency, staleness, settings = read_hello(world)
    if consistency != "bsp":
        from hvdtrain.ps.async_server import AsyncServer

        return AsyncServer(world, layout, wire, consistency, staleness).serve()
    shard = Shard(layout, world.server_index, len(world.worker_ranks), settings)
    served, expected = 0, None
    while True:
        op, step = read_controls(world, expected)
        if op == protocol.OP_DONE:
            return served
        if op == protocol.OP_PUSH:
            sum_step(world, shard, step)
            served, expected = served + 1, step + 1
            continue
        exchange_state(world, shard, op)
        expected = step


def exchange_state(world: PSWorld, shard: Shard, op: int) -> None:
    """``OP_STATE``: sends worker 0 the shard's pull residuals; ``OP_LOAD``: takes them from it."""
    source = world.worker_ranks[0]
    check(shard.residual is not None, world, source, "CONTROL's operation", op,
          f"{protocol.OPERATIONS[op]}, but this server keeps no state (no error feedback)")
    assert shard.residual is not None  # checked above
    if op == protocol.OP_STATE:
        world.comm.Send(shard.residual, dest=source, tag=protocol.STATE)
    else:
        protocol.receive(world, shard.residual, source, protocol.INIT, "INIT (pull residuals)")


@contextmanager
def _ignoring_stop_signals() -> Iterator[None]:
    """A stop signal (SIGTERM, SIGUSR1, SIGINT: :mod:`hvdtrain.signals`) reaches every rank of a
    job; the workers then checkpoint and say ``DONE``, so the server keeps serving them until they
    have. (A job that must end regardless is ended by the launcher's SIGKILL.)"""
    stops = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stops}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_server(world: PSWorld) -> int:
    """Serves one training on this server rank; on any failure prints one line naming this
    server and aborts the whole job (``MPI_Abort``), so that no worker waits for it."""
    try:
        with _ignoring_stop_signals():
            return serve(world)
    except Exception as exc:
        print(f"hvdtrain: error: parameter {world.name(world.rank)} failed: "
              f"{type(exc).__name__}: {exc}; ending the job", file=sys.stderr, flush=True)
        world.comm.Abort(1)
        raise  # not reached: Abort ends this process too
