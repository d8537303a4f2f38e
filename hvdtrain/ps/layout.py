"""Which server owns which part of the flat gradient: fixed-size chunks spread by hash.

The model's gradients, flattened and concatenated in model order, form one float32 vector of
``total`` elements. It is cut into chunks of ``chunk`` elements (the last one shorter); chunk ``c``
belongs to server :func:`owner` ``(c, S)``, a hash of its index. Hashing rather than striping is
BytePS's choice: the owner of a key does not depend on its neighbours, so a key keeps its server
when the model grows.
"""

from __future__ import annotations

from dataclasses import dataclass

GOLDEN = 0x9E3779B97F4A7C15
"""2^64 divided by the golden ratio, odd: the multiplier of Fibonacci hashing."""


def owner(chunk: int, servers: int) -> int:
    """The server (0 .. ``servers`` - 1) that owns chunk ``chunk``: Fibonacci hashing (Knuth,
    TAOCP vol. 3, section 6.4), the top of ``chunk x GOLDEN mod 2^64`` scaled to ``servers``. The
    owner depends on the index alone, and consecutive indices fall evenly on any number of servers
    (the golden ratio's multiples spread evenly over [0, 1)): 64 chunks put at most 1.12 x the
    mean on any of 2 to 8 servers, where CRC-32 mod 3 gave one of 3 servers half of them."""
    return ((chunk * GOLDEN) & 0xFFFF_FFFF_FFFF_FFFF) * servers >> 64


@dataclass(frozen=True)
class ChunkLayout:
    """The chunks of a flat vector of ``total`` elements and their servers."""

    total: int
    chunk: int
    servers: int

    @property
    def count(self) -> int:
        """The number of chunks (one, empty, for an empty vector)."""
        return max(1, -(-self.total // self.chunk))

    def bounds(self, index: int) -> tuple[int, int]:
        """The [start, stop) elements of chunk ``index``."""
        start = index * self.chunk
        return start, min(start + self.chunk, self.total)

    def owned(self, server: int) -> list[int]:
        """The chunks server ``server`` owns, ascending: the order their messages travel in."""
        return [c for c in range(self.count) if owner(c, self.servers) == server]

    def elements(self, server: int) -> int:
        """How many elements server ``server`` holds."""
        return sum(stop - start for start, stop in map(self.bounds, self.owned(server)))


def travel_order(layout: ChunkLayout, first_server: int, descending: bool) -> list[int]:
    """The chunks in the order a worker pushes them: round robin over the servers from
    ``first_server`` on, each server's chunks in descending (or ascending) index order.

    Each server thus gets every worker's chunks in one order, its own, which it receives them in
    (:mod:`hvdtrain.ps.protocol`). Workers that start at different servers push to different
    servers at each moment, where in plain index order workers in step push the same chunk to the
    same server at once, leaving the other servers' links idle. The order stays close to
    descending index order, the order a backward pass produces a sequential model's gradients
    in."""
    own = [sorted(layout.owned(s), reverse=descending) for s in range(layout.servers)]
    order = []
    for place in range(max(map(len, own))):
        for turn in range(layout.servers):
            chunks = own[(first_server + turn) % layout.servers]
            if place < len(chunks):
                order.append(chunks[place])
    return order


def chunk_elements(chunk_kib: int) -> int:
    """Float32 elements in a chunk of ``chunk_kib`` KiB."""
    return max(1, chunk_kib * 1024 // 4)


MIN_CHUNKS = 64
"""Dedicated servers: the fewest chunks a flat vector is cut into. A server answers a chunk once
every worker pushed it, so the pulls pipeline behind the pushes only where a chunk is small beside
the whole push, and the more chunks, the more evenly their hashes spread over the servers (16 a
server at 4 servers). Not a function of the number of servers: a run resumed on another number
cuts its vector, and draws its random chunks, as before."""
MIN_CHUNK = 64 * 1024 // 4
"""Nor smaller than 64 KiB: below that a message's cost is its overhead, not its bytes."""


def server_chunk(total: int, chunk_kib: int) -> int:
    """The chunk, in elements, that dedicated servers use for a flat vector of ``total``: at
    most ``ps.chunk_kib`` KiB, smaller where that would give fewer than :data:`MIN_CHUNKS`
    chunks (down to :data:`MIN_CHUNK`)."""
    wanted = max(MIN_CHUNK, -(-total // MIN_CHUNKS))
    return min(chunk_elements(chunk_kib), wanted)
