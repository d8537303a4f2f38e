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

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from hvdtrain.errors import HvdtrainError
from hvdtrain.ps import protocol
from hvdtrain.ps.layout import Layout
from hvdtrain.ps.world import PSWorld


class ProtocolError(HvdtrainError):
    """Workers sent what a server cannot serve (a different version, layout or step)."""


class Shard:
    """This server's chunks of the flat gradient: a receive buffer per worker and chunk (in the
    wire dtype), the chunk sums (float32) and what it sends back (the sums in the wire dtype)."""

    def __init__(self, layout: Layout, server: int, workers: int, wire: str = "float32") -> None:
        self.chunks = layout.owned(server)
        sizes = [stop - start for start, stop in map(layout.bounds, self.chunks)]
        self.received = [[np.empty(n, wire) for n in sizes] for _ in range(workers)]
        self.sums = [np.empty(n, np.float32) for n in sizes]
        self.sent = self.sums if wire == "float32" else [np.empty(n, wire) for n in sizes]

    @property
    def elements(self) -> int:
        """Elements this server sums per step."""
        return sum(s.size for s in self.sums)


def read_hello(world: PSWorld) -> tuple[Layout, str, str, int]:
    """The layout, wire dtype, consistency and staleness bound every worker announced; they must
    agree with each other and with this server."""
    messages = np.zeros((len(world.worker_ranks), protocol.HELLO_LENGTH), np.int64)
    for i, rank in enumerate(world.worker_ranks):
        world.comm.Recv(messages[i], source=rank, tag=protocol.HELLO)
    first = messages[0]
    if (messages != first).any():
        raise ProtocolError(f"the workers announced different layouts: {messages.tolist()}")
    version, total, chunk, servers, workers, wire, consistency, staleness = (int(v) for v in first)
    if version != protocol.VERSION:
        raise ProtocolError(f"the workers speak protocol {version}, this server {protocol.VERSION}")
    if (servers, workers) != (len(world.servers), len(world.worker_ranks)):
        raise ProtocolError(f"the workers count {servers} server(s) and {workers} worker(s), "
                            f"the job has {len(world.servers)} and {len(world.worker_ranks)}")
    return (Layout(total, chunk, servers), protocol.WIRE_DTYPES[wire],
            protocol.CONSISTENCIES[consistency], staleness)


def read_controls(world: PSWorld, step: int) -> int:
    """The operation all workers asked for at ``step``: ``OP_PUSH`` or ``OP_DONE``."""
    ranks = world.worker_ranks
    messages = np.zeros((len(ranks), protocol.CONTROL_LENGTH), np.int64)
    requests = [world.comm.Irecv(messages[i], source=r, tag=protocol.CONTROL)
                for i, r in enumerate(ranks)]
    protocol.waitall(requests)
    ops, steps = set(messages[:, 0].tolist()), set(messages[:, 1].tolist())
    if len(ops) != 1 or steps != {step}:
        raise ProtocolError(f"at step {step} the workers asked for {messages[:, :2].tolist()} "
                            "([operation, step] by worker): they disagree")
    return int(messages[0, 0])


def sum_step(world: PSWorld, shard: Shard) -> None:
    """Receives one step's chunks from every worker and sends each chunk's sum back."""
    comm, ranks = world.comm, world.worker_ranks
    arriving = [[comm.Irecv(protocol.raw(shard.received[w][i]), source=r, tag=protocol.PUSH)
                 for w, r in enumerate(ranks)] for i in range(len(shard.sums))]
    leaving = []
    for i, (total, sent) in enumerate(zip(shard.sums, shard.sent, strict=True)):
        protocol.waitall(arriving[i])
        np.copyto(total, shard.received[0][i])
        for w in range(1, len(ranks)):
            total += shard.received[w][i]
        if sent is not total:
            np.copyto(sent, total, casting="same_kind")
        leaving += [comm.Isend(protocol.raw(sent), dest=r, tag=protocol.PULL) for r in ranks]
    protocol.waitall(leaving)


def serve(world: PSWorld) -> int:
    """Serves one training until its workers say ``DONE``; returns the steps served (under
    ``ssp``/``asp``: the pushes applied)."""
    layout, wire, consistency, staleness = read_hello(world)
    if consistency != "bsp":
        from hvdtrain.ps.async_server import AsyncServer

        return AsyncServer(world, layout, wire, consistency, staleness).serve()
    shard = Shard(layout, world.server_index, len(world.worker_ranks), wire)
    step = 0
    while read_controls(world, step) == protocol.OP_PUSH:
        sum_step(world, shard)
        step += 1
    return step


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
