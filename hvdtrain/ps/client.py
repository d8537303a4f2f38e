"""A worker's side of the parameter servers: push the flat gradient, pull its sum over workers."""

from __future__ import annotations

from typing import Any

import numpy as np

from hvdtrain.ps import protocol
from hvdtrain.ps.layout import Layout
from hvdtrain.ps.world import PSWorld


class PSClient:
    """Pushes and pulls one flat float32 vector of ``total`` elements through the servers, sent
    as ``wire`` (float32, or float16 for half the bytes).

    Every chunk's push and pull are posted at once (``Isend``/``Irecv``), chunks of all servers
    interleaved in index order, so the servers sum early chunks while later ones still travel and
    pulls overlap pushes. A server that does not answer within ``timeout_s`` ends the wait with
    :class:`hvdtrain.ps.protocol.ServerLost` naming it.
    """

    def __init__(self, world: PSWorld, total: int, chunk: int, timeout_s: float,
                 wire: str = "float32") -> None:
        self.world, self.timeout_s, self.wire = world, timeout_s, np.dtype(wire)
        self.layout = Layout(total, chunk, len(world.servers))
        self.routes = [(*self.layout.bounds(c), world.servers[owner])
                       for owner in range(len(world.servers)) for c in self.layout.owned(owner)]
        self.routes.sort()  # index order: every server's first chunk leaves early
        self.summed = np.empty(total, self.wire)
        self.step = 0
        self.pushed_bytes = self.pulled_bytes = 0
        """Bytes of gradient sent to and received from the servers by the last step."""
        message = protocol.hello(total, chunk, len(world.servers), len(world.worker_ranks), wire)
        self._wait([(world.comm.Isend(message, dest=s, tag=protocol.HELLO), s)
                    for s in world.servers], "the start")

    def push_pull(self, flat: np.ndarray) -> np.ndarray:
        """The sum over all workers of ``flat`` (contiguous float32, ``total`` elements), in the
        wire dtype. The result lives in a buffer that the next call overwrites."""
        flat = flat if flat.dtype == self.wire else flat.astype(self.wire)
        comm, requests = self.world.comm, self._controls(protocol.OP_PUSH)
        summed, sent = protocol.raw(self.summed), protocol.raw(flat)
        for start, stop, server in self.routes:
            requests.append((comm.Irecv(summed[start:stop], source=server, tag=protocol.PULL),
                             server))
            requests.append((comm.Isend(sent[start:stop], dest=server, tag=protocol.PUSH), server))
        self._wait(requests, f"step {self.step}")
        self.step += 1
        self.pushed_bytes = self.pulled_bytes = flat.nbytes
        return self.summed

    def finish(self) -> None:
        """Tells every server that this worker's training ended."""
        self._wait(self._controls(protocol.OP_DONE), "the end of the training")

    def _controls(self, op: int) -> list[tuple[Any, int]]:
        message = protocol.control(op, self.step)
        return [(self.world.comm.Isend(message, dest=s, tag=protocol.CONTROL), s)
                for s in self.world.servers]

    def _wait(self, requests: list[tuple[Any, int]], when: str) -> None:
        def describe(peers: list[int]) -> str:
            names = ", ".join(f"parameter {self.world.name(p)}" for p in peers)
            return (f"{names} did not answer {self.world.name(self.world.rank)} within "
                    f"ps.timeout_s={self.timeout_s:g} s at {when}: it died or hangs")
        protocol.wait(requests, self.timeout_s, describe)
