"""The server loop of ``ps.consistency=ssp`` and ``asp``: NumPy and mpi4py only.

Each push is applied on its own, as it arrives, by the server's optimizer on its shard
(:class:`hvdtrain.ps.optim.ShardOptimizer`, built from worker 0's ``INIT``); the worker then
pulls the shard's current parameters. Under ``asp`` the pull is answered at once; under ``ssp``
with bound ``s`` it is held while the worker is more than ``s`` pushes ahead of the slowest
(:class:`hvdtrain.ps.optim.Clocks`) and answered once the slowest catches up. The answer says
the version it carries and the staleness the push saw (``VERSIONS``), for the workers' metrics.

Why ``(N - 1)(2s + 1)`` bounds the staleness under ``ssp`` (N workers, counted in updates of
this server): worker ``w`` pulls after its k-th push only while every other worker's clock is at
least ``k - s``, and until its (k+1)-th push lands its clock stays k, so no other worker may pull
past clock ``k + s`` and thus pushes at most up to clock ``k + s + 1``. Between ``w``'s pull and
its next push each of the N - 1 others therefore pushes at most ``(k + s + 1) - (k - s) = 2s + 1``
times. (Ho et al.'s ``(N - 1)(s + 1)`` counts from the clock a pull waited for, not from the
version it got.)
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hvdtrain.ps import protocol
from hvdtrain.ps.layout import ChunkLayout
from hvdtrain.ps.mpi import PSWorld
from hvdtrain.ps.optim import OPTIMIZERS, Clocks, ShardOptimizer
from hvdtrain.ps.protocol import check, float_field
from hvdtrain.ps.shards import pack, state_names, unpack


def read_init(world: PSWorld, elements: int) -> tuple[ShardOptimizer, tuple[str, ...]]:
    """The shard's optimizer from worker 0's ``INIT``: its hyper-parameters, parameters and (when
    resumed) state; returns it with the names of its state vectors. Every field is checked before
    use: the buffer's size follows from the layout and a state count of 0 or the optimizer's."""
    source = worker = world.worker_ranks[0]
    hyper = protocol.receive(world, np.zeros(protocol.HYPER_LENGTH, np.float64), source,
                             protocol.INIT, "INIT's hyper-parameters")
    index = float(hyper[0])
    check(index.is_integer() and 0 <= index < len(OPTIMIZERS), world, worker, "INIT's optimizer",
          index, f"must be 0 .. {len(OPTIMIZERS) - 1} ({', '.join(OPTIMIZERS)})")
    for field, value in zip(("momentum", "weight_decay", "eps"), hyper[[1, 2, 5]], strict=True):
        float_field(world, worker, f"INIT's {field}", float(value))
    for field, value in zip(("beta1", "beta2"), hyper[3:5], strict=True):
        float_field(world, worker, f"INIT's {field}", float(value), high=1.0, high_open=True)
    name = OPTIMIZERS[int(index)]
    names = state_names(name, float(hyper[1]))
    counts = protocol.receive(world, np.zeros(2, np.int64), source, protocol.INIT,
                              "INIT's counts")
    steps, arrays = (int(v) for v in counts)
    check(steps >= 0, world, worker, "INIT's steps", steps, "must be >= 0")
    allowed = sorted({0, len(names)})  # none before the first step
    check(arrays in allowed, world, worker, "INIT's arrays", arrays,
          f"must be {' or '.join(map(str, allowed))} ({name} keeps {len(names)} state vectors)")
    buffer = protocol.receive(world, np.zeros((1 + arrays) * elements, np.float32), source,
                              protocol.INIT, "INIT's parameters")
    params, state = unpack(buffer, elements, names, arrays)
    optimizer = ShardOptimizer(name, params, lr=0.0, momentum=float(hyper[1]),
                               weight_decay=float(hyper[2]),
                               betas=(float(hyper[3]), float(hyper[4])), eps=float(hyper[5]),
                               steps=steps, state=state)
    return optimizer, names


def wait_any(requests: list[Any], start: int) -> int:
    """The index of a request among ``requests`` (None: none) that completed, looking from
    ``start`` round so that no worker starves; yields the core between polls after the first
    millisecond, as :func:`hvdtrain.ps.protocol.wait` does
    (:func:`~hvdtrain.ps.protocol.yield_core`)."""
    began, pause, count = time.monotonic(), 0.0, len(requests)
    while True:
        for offset in range(count):
            i = (start + offset) % count
            if requests[i] is not None and requests[i].Test():
                return i
        pause = protocol.yield_core(time.monotonic() - began, pause)


class AsyncServer:
    """One server's shard under ``ssp``/``asp``: its optimizer, the workers' clocks, and a
    receive buffer, an answer buffer and the pending sends per worker."""

    def __init__(self, world: PSWorld, layout: ChunkLayout, wire: str, consistency: str,
                 staleness: int) -> None:
        self.world, self.ranks = world, world.worker_ranks
        self.consistency = consistency
        self.chunks = layout.owned(world.server_index)
        sizes = [stop - start for start, stop in map(layout.bounds, self.chunks)]
        offsets = np.cumsum([0, *sizes])
        self.spans = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))
        elements = int(offsets[-1])
        workers = len(self.ranks)
        self.received = [np.empty(elements, wire) for _ in range(workers)]
        self.answers = [np.empty(elements, np.float32) for _ in range(workers)]
        self.headers = [np.zeros(2, np.int64) for _ in range(workers)]
        self.sending: list[list[Any]] = [[] for _ in range(workers)]
        self.clocks = Clocks(workers, staleness if consistency == "ssp" else None)
        self.held: dict[int, int] = {}
        """Workers whose pull ``ssp`` holds, with the staleness their push saw."""
        self.optimizer, self.names = read_init(world, elements)

    def serve(self) -> int:
        """Applies pushes until every worker said ``DONE``; returns the pushes applied."""
        controls = [np.zeros(protocol.CONTROL_LENGTH, np.int64) for _ in self.ranks]
        requests: list[Any] = [self._control(c, r) for c, r in zip(controls, self.ranks,
                                                                   strict=True)]
        done, last = 0, 0
        while done < len(self.ranks):
            w = last = wait_any(requests, last + 1)
            message = controls[w]
            op = self.check_control(w, message)
            if op == protocol.OP_DONE:
                requests[w], done = None, done + 1
                continue
            if op == protocol.OP_PUSH:
                self.push(w, int(message[2]), protocol.control_lr(message))
            else:
                self.send_state(w)
            requests[w] = self._control(message, self.ranks[w])
            self.release()
        self._finish_sends()
        return self.clocks.version

    def _control(self, message: np.ndarray, rank: int) -> protocol.Receive:
        return protocol.Receive(self.world, message, rank, protocol.CONTROL, "CONTROL")

    def check_control(self, w: int, message: np.ndarray) -> int:
        """Worker ``w``'s operation, once every field of its ``CONTROL`` is in range: a known
        operation (``LOAD`` is ``bsp``'s), a step, a version this server has reached, and a
        finite learning rate."""
        rank, world = self.ranks[w], self.world
        op, step, version = (int(v) for v in message[:3])
        known = {k: v for k, v in protocol.OPERATIONS.items() if k != protocol.OP_LOAD}
        check(op in known, world, rank, "CONTROL's operation", op,
              f"unknown to {self.consistency} servers (known: "
              f"{', '.join(f'{k} {v}' for k, v in known.items())})")
        check(step >= 0, world, rank, "CONTROL's step", step, "must be >= 0")
        if op == protocol.OP_PUSH:
            check(0 <= version <= self.clocks.version, world, rank, "CONTROL's version", version,
                  f"this server is at version {self.clocks.version}")
            float_field(world, rank, "CONTROL's lr", protocol.control_lr(message))
        return op

    def push(self, w: int, version: int, lr: float) -> None:
        """Receives worker ``w``'s gradient, applies it, and answers its pull unless held."""
        rank, got = self.ranks[w], self.received[w]
        protocol.waitall([protocol.Receive(self.world, got[a:b], rank, protocol.PUSH,
                                           f"PUSH of chunk {chunk}")
                          for (a, b), chunk in zip(self.spans, self.chunks, strict=True)])
        self.optimizer.lr = lr
        self.optimizer.step(got)
        stale = self.clocks.applied(w, version)
        if self.clocks.may_pull(w):
            self.answer(w, stale)
        else:
            self.held[w] = stale

    def release(self) -> None:
        """Answers the held pulls that ``ssp`` now allows."""
        for w in sorted(self.held):
            if self.clocks.may_pull(w):
                self.answer(w, self.held.pop(w))

    def answer(self, w: int, stale: int) -> None:
        """Sends worker ``w`` the current parameters (a copy: the next push changes them while
        the sends travel), after their version and the staleness its push saw."""
        comm, rank = self.world.comm, self.ranks[w]
        protocol.waitall(self.sending[w])  # the previous answer's buffers are free again
        np.copyto(self.answers[w], self.optimizer.params)
        self.headers[w][:] = (self.clocks.version, stale)
        self.sending[w] = [comm.Isend(self.headers[w], dest=rank, tag=protocol.VERSIONS)]
        self.sending[w] += [comm.Isend(self.answers[w][a:b], dest=rank, tag=protocol.PULL)
                            for a, b in self.spans]

    def send_state(self, w: int) -> None:
        """Sends worker ``w`` (worker 0, before a checkpoint) the shard's parameters and state."""
        opt = self.optimizer
        arrays = len(self.names) if opt.state else 0
        header = np.array([self.clocks.version, opt.steps, arrays], np.int64)
        rank = self.ranks[w]
        self.world.comm.Send(header, dest=rank, tag=protocol.STATE)
        self.world.comm.Send(pack(opt.params, opt.state, self.names), dest=rank,
                             tag=protocol.STATE)

    def _finish_sends(self) -> None:
        for sends in self.sending:
            protocol.waitall(sends)
