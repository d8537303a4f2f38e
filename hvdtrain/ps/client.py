"""A worker's side of the parameter servers: push the flat gradient, pull its sum over workers
(``bsp``), or pull the servers' current parameters (``ssp``, ``asp``)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from hvdtrain.compression.state import reshard
from hvdtrain.errors import HvdtrainError
from hvdtrain.ps import protocol, shards
from hvdtrain.ps.codec import WireSettings, encode, pull_scheme, push_scheme
from hvdtrain.ps.layout import ChunkLayout, owner, travel_order
from hvdtrain.ps.mpi import PSWorld


class PSClient:
    """Pushes and pulls one flat float32 vector of ``total`` elements through the servers, dense
    as ``wire`` (float32, or float16 for half the bytes) or compressed as ``settings`` say
    (:mod:`hvdtrain.ps.codec`; ``bsp`` only).

    Every chunk's pull is posted at once (:class:`hvdtrain.ps.protocol.Receive`, which checks
    its size) and the pushes (``Isend``) go out :data:`hvdtrain.ps.protocol.PUSH_WINDOW` at a time in
    :func:`hvdtrain.ps.layout.travel_order` (round robin over the servers, from this worker's own
    first server on, each server's chunks in descending index order), so the servers sum early
    chunks while later ones still travel and pulls overlap pushes. :meth:`push_pull` pushes a
    vector that is complete; :meth:`begin`, :meth:`filled` and :meth:`end` push each chunk as
    soon as the caller has written it (the backward pass produces the last layers' gradients
    first, hence the descending order), from a thread of their own. A server that does not
    answer within ``timeout_s`` ends the wait with :class:`hvdtrain.ps.protocol.ServerLost`
    naming it.
    """

    descending = True
    """The order each server's chunks travel in (``bsp``'s servers answer in it too)."""

    def __init__(self, world: PSWorld, total: int, chunk: int, timeout_s: float,
                 wire: str = "float32", settings: WireSettings | None = None) -> None:
        self.world, self.timeout_s, self.wire = world, timeout_s, np.dtype(wire)
        self.settings = settings or WireSettings("fp16" if wire == "float16" else "none")
        self.layout = ChunkLayout(total, chunk, len(world.servers))
        if self.layout.count > protocol.MAX_CHUNKS:  # the servers would refuse this HELLO
            raise HvdtrainError(f"ps.chunk_kib: the {total}-element gradient would travel in "
                                f"{self.layout.count} chunks of {chunk} elements, more than the "
                                f"{protocol.MAX_CHUNKS} a server lays out: raise ps.chunk_kib")
        place = world.worker_ranks.index(world.rank)  # this worker's first server
        self.routes = [(*self.layout.bounds(c), world.servers[owner(c, self.layout.servers)], c)
                       for c in travel_order(self.layout, place, self.descending)]
        push, pull = push_scheme(self.settings), pull_scheme(self.settings)
        self.pushes = [push.codec(stop - start) for start, stop, _, _ in self.routes]
        self.pull_codecs = [pull.codec(stop - start) for start, stop, _, _ in self.routes]
        self.pulls = [codec.buffers(stop - start)
                      for codec, (start, stop, _, _) in zip(self.pull_codecs, self.routes,
                                                            strict=True)]
        self.residual = np.zeros(total, np.float32) if self.settings.feedback else None
        """What this worker's pushes left unsent (error feedback), or None."""
        self.summed = np.empty(total, np.float32)
        self.step = 0
        """Steps pushed, counted on across resumptions (:meth:`restore`): it seeds draws."""
        self.pushed_bytes = self.pulled_bytes = 0
        """Bytes of gradient sent to and received from the servers by the last step."""
        self._route_of = [0] * self.layout.count  # chunk index -> its place in routes
        for index, (_, _, _, c) in enumerate(self.routes):
            self._route_of[c] = index
        self._missing: list[int] = []  # per route: elements not yet written (begin/filled)
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        message = self._hello()
        self._wait([(world.comm.Isend(message, dest=s, tag=protocol.HELLO), s)
                    for s in world.servers], "the start")

    def _hello(self) -> np.ndarray:
        """This worker's ``HELLO``."""
        return protocol.hello(self.layout.total, self.layout.chunk, self.layout.servers,
                              len(self.world.worker_ranks), str(self.wire),
                              settings=self.settings.to_ints())

    def push_pull(self, flat: np.ndarray) -> np.ndarray:
        """The sum over all workers of ``flat`` (contiguous float32, ``total`` elements), as the
        pulls decode it (float32). The result lives in a buffer that the next call overwrites."""
        self._missing = [0] * len(self.routes)
        self._exchange(flat)
        return self._decode()

    def begin(self, flat: np.ndarray) -> None:
        """Starts a step whose gradient the caller is still writing into ``flat`` (contiguous
        float32, ``total`` elements): each chunk leaves once :meth:`filled` has reported all of
        it; :meth:`end` returns the sum. The caller must not write a range twice in a step."""
        self._missing = [stop - start for start, stop, _, _ in self.routes]
        self._failure = None
        self._thread = threading.Thread(target=self._exchange_reporting, args=(flat,),
                                        name="hvdtrain-ps-push", daemon=True)
        self._thread.start()

    def filled(self, start: int, stop: int) -> None:
        """Elements [``start``, ``stop``) of the vector given to :meth:`begin` hold their final
        values: the chunks they complete may leave."""
        chunk = self.layout.chunk
        for c in range(start // chunk, -(-stop // chunk)):
            a, b = self.layout.bounds(c)
            self._missing[self._route_of[c]] -= min(b, stop) - max(a, start)

    def end(self) -> np.ndarray:
        """After :meth:`begin`: every element written, waits for the pushes and pulls to finish;
        returns the sum as :meth:`push_pull` does."""
        assert self._thread is not None, "end() without begin()"
        self._missing = [0] * len(self.routes)
        self._thread.join()
        self._thread = None
        if self._failure is not None:
            raise self._failure
        return self._decode()

    def _exchange_reporting(self, flat: np.ndarray) -> None:
        """:meth:`_exchange` on the push thread, keeping its exception for :meth:`end`."""
        try:
            self._exchange(flat)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            self._failure = exc

    def _exchange(self, flat: np.ndarray) -> None:
        """Posts the step's pulls, then pushes each chunk of ``flat`` once nothing of it is
        missing (:attr:`_missing`, which the caller's thread lowers), and waits for both."""
        comm, requests = self.world.comm, self._controls(protocol.OP_PUSH)
        requests += [(protocol.Receive(self.world, b, server, protocol.PULL,
                                       f"PULL of chunk {chunk}"), server)
                     for (_, _, server, chunk), pulled in zip(self.routes, self.pulls, strict=True)
                     for b in pulled]
        residual, rank = self.residual, self.world.rank
        in_flight: list[list[np.ndarray]] = []  # alive until the sends complete

        def pushes() -> Iterator[list[tuple[Any, int]] | None]:
            for index, ((start, stop, server, chunk), codec) in enumerate(
                    zip(self.routes, self.pushes, strict=True)):
                while self._missing[index] > 0:
                    yield protocol.NOT_READY
                part = None if residual is None else residual[start:stop]
                sent = encode(codec, flat[start:stop], part, self.step, chunk, rank)
                in_flight.append(sent)
                yield [(comm.Isend(protocol.raw(b), dest=server, tag=protocol.PUSH), server)
                       for b in sent]

        self._wait(requests, f"step {self.step}", pushes())
        self.pushed_bytes = sum(b.nbytes for sent in in_flight for b in sent)

    def _decode(self) -> np.ndarray:
        """The step's pulls decoded into :attr:`summed`; counts the step."""
        for (start, stop, server, chunk), codec, pulled in zip(self.routes, self.pull_codecs,
                                                               self.pulls, strict=True):
            problem = codec.problem(pulled, stop - start)
            if problem:  # decoding would wrap it
                raise protocol.refused(self.world, server, f"PULL of chunk {chunk} with {problem}")
            self.summed[start:stop] = codec.decode(pulled, stop - start)
        self.step += 1
        self.pulled_bytes = sum(b.nbytes for pulled in self.pulls for b in pulled)
        return self.summed

    def fetch_residuals(self) -> tuple[np.ndarray, np.ndarray | None] | None:
        """Every worker, before a checkpoint, under error feedback: worker 0 receives every
        worker's push residuals (rows by worker) and, under ``topk``, the servers' pull residuals
        (one whole vector, else None) and returns them; None on the other workers and without
        error feedback."""
        if self.residual is None:
            return None
        comm, workers, servers = self.world.comm, self.world.worker_ranks, self.world.servers
        from_servers = self.settings.server_feedback
        requests = self._controls(protocol.OP_STATE) if from_servers else []
        if self.world.rank != workers[0]:
            requests.append((comm.Isend(self.residual, dest=workers[0], tag=protocol.ROWS),
                             workers[0]))
            self._wait(requests, "a checkpoint (sending residuals to worker 0)")
            return None
        rows = np.empty((len(workers), self.layout.total), np.float32)
        rows[0] = self.residual
        requests += [(protocol.Receive(self.world, rows[i], r, protocol.ROWS,
                                       "ROWS (push residuals)"), r)
                     for i, r in enumerate(workers) if i]
        parts = [np.empty(self.layout.elements(i), np.float32)
                 for i in range(len(servers) if from_servers else 0)]
        requests += [(protocol.Receive(self.world, part, s, protocol.STATE,
                                       "STATE (pull residuals)"), s)
                     for part, s in zip(parts, servers, strict=False)]
        self._wait(requests, "a checkpoint (fetching the residuals)")
        if not from_servers:
            return rows, None
        server = np.zeros(self.layout.total, np.float32)
        for index, part in enumerate(parts):
            shards.put(server, part, self.layout, index)
        return rows, server

    def restore(self, step: int, saved: tuple[np.ndarray, np.ndarray | None] | None) -> None:
        """Every worker, before its first push (compressed methods): worker 0 hands the others
        the ``step`` to go on from and, when it resumed with error feedback, ``saved``: the push
        residuals (rows by worker of the run that saved them, re-sharded for this number of
        workers by :func:`hvdtrain.compression.state.reshard`) and under ``topk`` the servers'
        pull residuals (a whole vector, cut by this run's layout: any number of servers). The
        others pass anything."""
        comm, workers = self.world.comm, self.world.worker_ranks
        head = np.array([step, int(saved is not None)], np.int64)
        if self.world.rank == workers[0]:
            self._wait([(comm.Isend(head, dest=r, tag=protocol.ROWS), r) for r in workers[1:]],
                       "the start (handing out the step)")
        else:
            self._wait([(protocol.Receive(self.world, head, workers[0], protocol.ROWS,
                                          "ROWS (step)"), workers[0])],
                       "the start (waiting for worker 0)")
            protocol.check(head[0] >= 0, self.world, workers[0], "ROWS' step", int(head[0]),
                           "must be >= 0")
            protocol.check(head[1] in (0, 1), self.world, workers[0], "ROWS' resumed",
                           int(head[1]), "must be 0 or 1")
        self.step = int(head[0])
        if not head[1] or self.residual is None:
            return
        servers = self.world.servers if self.settings.server_feedback else ()
        requests = self._controls(protocol.OP_LOAD) if servers else []
        if self.world.rank != workers[0]:
            requests.append((protocol.Receive(self.world, self.residual, workers[0],
                                              protocol.ROWS, "ROWS (push residuals)"),
                             workers[0]))
        else:
            assert saved is not None  # head[1] says so
            rows = reshard(saved[0], len(workers))
            self.residual[:] = rows[0]
            requests += [(comm.Isend(rows[i], dest=r, tag=protocol.ROWS), r)
                         for i, r in enumerate(workers) if i]
            whole = saved[1] if saved[1] is not None else np.zeros(self.layout.total, np.float32)
            parts = [shards.take(whole, self.layout, i) for i in range(len(servers))]
            requests += [(comm.Isend(part, dest=s, tag=protocol.INIT), s)
                         for part, s in zip(parts, servers, strict=True)]
        self._wait(requests, "the start (restoring the residuals)")

    def finish(self) -> None:
        """Tells every server that this worker's training ended."""
        self._wait(self._controls(protocol.OP_DONE), "the end of the training")

    def _controls(self, op: int) -> list[tuple[Any, int]]:
        message = protocol.control(op, self.step)
        return [(self.world.comm.Isend(message, dest=s, tag=protocol.CONTROL), s)
                for s in self.world.servers]

    def _wait(self, requests: list[tuple[Any, int]], when: str,
              pushes: Iterable[list[tuple[Any, int]] | None] = ()) -> None:
        """Waits for ``requests`` and ``pushes`` (posted chunk by chunk: :func:`protocol.wait`)."""
        def describe(peers: list[int]) -> str:
            names = ", ".join(f"parameter {self.world.name(p)}" if p in self.world.servers
                              else self.world.name(p) for p in peers)
            return (f"{names} did not answer {self.world.name(self.world.rank)} within "
                    f"ps.timeout_s={self.timeout_s:g} s at {when}: it died or hangs")
        protocol.wait(requests, self.timeout_s, describe, pushes, protocol.PUSH_WINDOW)


class AsyncPSClient(PSClient):
    """A worker's client under ``ps.consistency=ssp``/``asp``: pushes its gradient with the
    learning rate to apply it with and pulls the servers' current parameters (float32), each
    server answering with the version it sent and the staleness the push saw.

    Worker 0 also starts the servers' optimizers (:meth:`init`) and fetches their state before a
    checkpoint (:meth:`fetch_state`).
    """

    descending = False  # the asynchronous servers take a push whole, in index order

    def __init__(self, world: PSWorld, total: int, chunk: int, timeout_s: float,
                 wire: str = "float32", consistency: str = "asp", staleness: int = 0) -> None:
        self.consistency, self.staleness_bound = consistency, staleness
        super().__init__(world, total, chunk, timeout_s, wire)
        self.params = np.empty(total, np.float32)
        self.answers = np.zeros((len(world.servers), 2), np.int64)
        self.versions = [0] * len(world.servers)
        """The version of each server's parameters this worker holds (what its push builds on)."""
        self.staleness = 0
        """The staleness the last push saw: the largest over the servers."""

    def _hello(self) -> np.ndarray:
        return protocol.hello(self.layout.total, self.layout.chunk, self.layout.servers,
                              len(self.world.worker_ranks), str(self.wire), self.consistency,
                              self.staleness_bound)

    def init(self, params: np.ndarray, hyper: np.ndarray, steps: int,
             state: dict[str, np.ndarray], names: tuple[str, ...]) -> None:
        """Worker 0: gives every server its shard of ``params`` (the whole flat vector), the
        optimizer's ``hyper``-parameters (``INIT``'s float64 row) and, when resumed, its
        ``steps`` and whole-vector ``state`` (re-sharded by this run's layout)."""
        comm, requests, keep = self.world.comm, [], []
        arrays = len(names) if state else 0
        counts = np.array([steps, arrays], np.int64)
        for index, server in enumerate(self.world.servers):
            shard_state = {n: shards.take(state[n], self.layout, index) for n in names[:arrays]}
            buffer = shards.pack(shards.take(params, self.layout, index), shard_state, names)
            keep.append(buffer)
            for message in (hyper, counts, buffer):
                requests.append((comm.Isend(message, dest=server, tag=protocol.INIT), server))
        self._wait(requests, "the start of the servers' optimizers")

    def push_pull(self, flat: np.ndarray, lr: float = 0.0) -> np.ndarray:
        """Pushes ``flat`` (this worker's gradient) to be applied with ``lr``; returns the current
        parameters (a buffer that the next call overwrites)."""
        flat = flat if flat.dtype == self.wire else flat.astype(self.wire)
        comm, sent = self.world.comm, protocol.raw(flat)
        requests = []
        for index, server in enumerate(self.world.servers):
            message = protocol.control(protocol.OP_PUSH, self.step, self.versions[index], lr)
            requests.append((comm.Isend(message, dest=server, tag=protocol.CONTROL), server))
            requests.append((protocol.Receive(self.world, self.answers[index], server,
                                              protocol.VERSIONS, "VERSIONS"), server))
        requests += [(protocol.Receive(self.world, self.params[start:stop], server,
                                       protocol.PULL, f"PULL of chunk {chunk}"), server)
                     for start, stop, server, chunk in self.routes]
        pushes = ([(comm.Isend(sent[start:stop], dest=server, tag=protocol.PUSH), server)]
                  for start, stop, server, _ in self.routes)
        self._wait(requests, f"step {self.step}", pushes)
        for server, (version, stale) in zip(self.world.servers, self.answers.tolist(),
                                            strict=True):
            protocol.check(version >= 0, self.world, server, "VERSIONS' version", version,
                           "must be >= 0")
            protocol.check(stale >= 0, self.world, server, "VERSIONS' staleness", stale,
                           "must be >= 0")
        self.step += 1
        self.versions = [int(v) for v in self.answers[:, 0]]
        self.staleness = int(self.answers[:, 1].max())
        self.pushed_bytes, self.pulled_bytes = flat.nbytes, self.params.nbytes
        return self.params

    def fetch_state(self, names: tuple[str, ...]) -> tuple[int, dict[str, np.ndarray]]:
        """Worker 0, before a checkpoint: every server's parameters (into :attr:`params`, whose
        versions it now holds), the optimizer's steps and its state as whole vectors (empty
        before the first step)."""
        comm, total = self.world.comm, self.layout.total
        requests, buffers, headers, bodies = [], [], [], []
        for index, server in enumerate(self.world.servers):
            header = np.zeros(3, np.int64)
            elements = self.layout.elements(index)
            buffer = np.zeros((1 + len(names)) * elements, np.float32)
            headers.append(header)
            buffers.append(buffer)
            requests.append((protocol.Receive(self.world, header, server, protocol.STATE,
                                              "STATE's header"), server))
            # The parameters alone before the first step (no state yet), else with the state.
            bodies.append(protocol.Receive(self.world, buffer, server, protocol.STATE,
                                           "STATE's parameters", (4 * elements, buffer.nbytes)))
            requests.append((bodies[-1], server))
            message = protocol.control(protocol.OP_STATE, self.step)
            requests.append((comm.Isend(message, dest=server, tag=protocol.CONTROL), server))
        self._wait(requests, "a checkpoint (fetching the servers' state)")
        arrays = int(headers[0][2])
        for index, (server, header, body) in enumerate(zip(self.world.servers, headers, bodies,
                                                           strict=True)):
            self._check_state(server, header, body.count // 4, self.layout.elements(index),
                              arrays, len(names))
        state = {n: np.zeros(total, np.float32) for n in names[:arrays]}
        for index, (header, buffer) in enumerate(zip(headers, buffers, strict=True)):
            params, shard_state = shards.unpack(buffer, self.layout.elements(index), names, arrays)
            shards.put(self.params, params, self.layout, index)
            for name, values in shard_state.items():
                shards.put(state[name], values, self.layout, index)
            self.versions[index] = int(header[0])
        return int(headers[0][1]), state

    def _check_state(self, server: int, header: np.ndarray, received: int, elements: int,
                     arrays: int, names: int) -> None:
        """Refuses a ``STATE`` answer whose header is out of range or disagrees with the other
        servers' (``arrays``) or with the elements it carried (``received``)."""
        version, steps, count = (int(v) for v in header)
        for field, value in (("version", version), ("steps", steps)):
            protocol.check(value >= 0, self.world, server, f"STATE's {field}", value,
                           "must be >= 0")
        protocol.check(count == arrays and count in (0, names), self.world, server,
                       "STATE's arrays", count,
                       f"must be 0 or {names}, as every server's ({arrays} from the first)")
        protocol.check(received == (1 + count) * elements, self.world, server,
                       "STATE's parameters", f"{received} elements",
                       f"{count} state vector(s) of a {elements}-element shard take "
                       f"{(1 + count) * elements}")
