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

from hvdtrain.errors import HvdtrainError
from hvdtrain.ps import protocol
from hvdtrain.ps.codec import WireSettings, encode, pull_scheme, push_scheme
from hvdtrain.ps.layout import Layout
from hvdtrain.ps.world import PSWorld


class ProtocolError(HvdtrainError):
    """Workers sent what a server cannot serve (a different version, layout or step)."""


class Shard:
    """This server's chunks of the flat gradient: the receive buffers per worker and chunk (its
    push codec's), the chunk sums (float32), and under ``topk`` with error feedback what the
    pulls left unsent (one vector in the shard's layout, :mod:`hvdtrain.ps.shards`, with a view
    per chunk)."""

    def __init__(self, layout: Layout, server: int, workers: int,
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


def read_hello(world: PSWorld) -> tuple[Layout, str, str, int, WireSettings]:
    """The layout, wire dtype, consistency, staleness bound and compression settings every worker
    announced; they must agree with each other and with this server."""
    messages = np.zeros((len(world.worker_ranks), protocol.HELLO_LENGTH), np.int64)
    for i, rank in enumerate(world.worker_ranks):
        world.comm.Recv(messages[i], source=rank, tag=protocol.HELLO)
    first = messages[0]
    if (messages != first).any():
        raise ProtocolError(f"the workers announced different layouts: {messages.tolist()}")
    version, total, chunk, servers, workers, wire, consistency, staleness = (
        int(v) for v in first[:8])
    if version != protocol.VERSION:
        raise ProtocolError(f"the workers speak protocol {version}, this server {protocol.VERSION}")
    if (servers, workers) != (len(world.servers), len(world.worker_ranks)):
        raise ProtocolError(f"the workers count {servers} server(s) and {workers} worker(s), "
                            f"the job has {len(world.servers)} and {len(world.worker_ranks)}")
    return (Layout(total, chunk, servers), protocol.WIRE_DTYPES[wire],
            protocol.CONSISTENCIES[consistency], staleness, WireSettings.from_ints(first[8:]))


def read_controls(world: PSWorld, step: int | None) -> tuple[int, int]:
    """The operation all workers asked for and the step they are at: ``OP_PUSH``, ``OP_DONE``,
    ``OP_STATE`` or ``OP_LOAD``. ``step``: the step they must be at (None before the first
    control: a resumed run goes on from its checkpoint's step)."""
    ranks = world.worker_ranks
    messages = np.zeros((len(ranks), protocol.CONTROL_LENGTH), np.int64)
    requests = [world.comm.Irecv(messages[i], source=r, tag=protocol.CONTROL)
                for i, r in enumerate(ranks)]
    protocol.waitall(requests)
    ops, steps = set(messages[:, 0].tolist()), set(messages[:, 1].tolist())
    if len(ops) != 1 or len(steps) != 1 or (step is not None and steps != {step}):
        raise ProtocolError(f"at step {step} the workers asked for {messages[:, :2].tolist()} "
                            "([operation, step] by worker): they disagree")
    return int(messages[0, 0]), int(messages[0, 1])


def sum_step(world: PSWorld, shard: Shard, step: int = 0) -> None:
    """Receives one step's chunks from every worker and sends each chunk's sum back, both in
    descending chunk order (the order the workers push in: :mod:`hvdtrain.ps.protocol`)."""
    comm, ranks = world.comm, world.worker_ranks
    order = range(len(shard.sums) - 1, -1, -1)
    arriving = {i: [comm.Irecv(protocol.raw(b), source=r, tag=protocol.PUSH)
                    for w, r in enumerate(ranks) for b in shard.received[w][i]]
                for i in order}
    leaving, in_flight = [], []
    for i in order:
        protocol.waitall(arriving[i])
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
    if shard.residual is None:
        raise ProtocolError(f"the workers asked for operation {op}, but this server keeps no "
                            "state (no error feedback)")
    source = world.worker_ranks[0]
    if op == protocol.OP_STATE:
        world.comm.Send(shard.residual, dest=source, tag=protocol.STATE)
    elif op == protocol.OP_LOAD:
        world.comm.Recv(shard.residual, source=source, tag=protocol.INIT)
    else:
        raise ProtocolError(f"the workers asked for operation {op}, which bsp servers lack")


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
