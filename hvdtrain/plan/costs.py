"""The time of one collective of ``m`` bytes per rank, by the alpha-beta model: a message costs a
latency ``alpha`` plus its bytes over the bandwidth ``B``; a ring's step also what a calibrated
link measured beyond that at its chunk (:meth:`~hvdtrain.plan.cluster.Link.step_s`). Every
formula and its source is in docs/planner.md; the unit tests check them against hand-computed
values and their limits.
"""

from __future__ import annotations

from hvdtrain.plan.cluster import Link


def ring_allreduce(m: float, n: int, link: Link, overhead_s: float = 0.0) -> float:
    """Ring allreduce of ``m`` bytes over ``n`` ranks (Patarasuk & Yuan 2009, the bandwidth-optimal
    bound): ``2(n-1)`` steps of ``m/n`` bytes, ``2(n-1) alpha + 2(n-1)/n m/B``, plus a fixed
    ``overhead_s`` per call; 0 for one rank."""
    if n <= 1 or m <= 0:
        return 0.0
    return overhead_s + 2 * (n - 1) * link.step_s(m / n)


def ring_allgather(m: float, n: int, link: Link, overhead_s: float = 0.0) -> float:
    """Ring allgather where each of ``n`` ranks contributes ``m`` bytes: ``(n-1) alpha +
    (n-1) m/B`` (each rank receives the other ``n-1`` contributions; Thakur et al. 2005)."""
    if n <= 1 or m <= 0:
        return 0.0
    return overhead_s + (n - 1) * link.step_s(m)


def flat_allreduce(m: float, nodes: int, per_node: int, intra: Link, inter: Link,
                   overhead_s: float = 0.0) -> float:
    """One ring over every rank of ``nodes`` x ``per_node``, a node's ranks consecutive. Each of
    the ``2(n-1)`` steps moves ``m/n`` over every link at once; between nodes the ring crosses each
    node's link once each way, so the slower link sets each step: ``2(n-1) (alpha + m/(n B))``."""
    n = nodes * per_node
    if n <= 1 or m <= 0:
        return 0.0
    link = intra if nodes == 1 else _slower(intra if per_node > 1 else inter, inter, m / n)
    return overhead_s + 2 * (n - 1) * link.step_s(m / n)


def flat_half(m: float, nodes: int, per_node: int, intra: Link, inter: Link,
                overhead_s: float = 0.0) -> float:
    """A reduce-scatter of ``m`` bytes (each rank keeps ``m/n`` of the sum), or the all-gather of
    ``m/n`` bytes a rank back into ``m``, on :func:`flat_allreduce`'s ring: one of its two halves,
    ``(n-1)`` steps of ``m/n``: ``o + (n-1) (alpha + m/(n B))`` (the ring allreduce is a
    reduce-scatter then an all-gather; Patarasuk & Yuan 2009)."""
    if nodes * per_node <= 1 or m <= 0:
        return 0.0
    return overhead_s + flat_allreduce(m, nodes, per_node, intra, inter) / 2


def _slower(a: Link, b: Link, chunk: float) -> Link:
    return a if a.step_s(chunk) >= b.step_s(chunk) else b


def hierarchical_allreduce(m: float, nodes: int, per_node: int, intra: Link, inter: Link,
                           overhead_s: float = 0.0) -> float:
    """Horovod's hierarchical allreduce (``HOROVOD_HIERARCHICAL_ALLREDUCE``): a reduce-scatter
    within each node, an allreduce of each ``m/g`` shard between the nodes (the ``g`` shards'
    rings share the node's link: ``g`` x ``m/g`` = ``m`` through it), an allgather within the
    node: ``2(g-1) alpha_i + 2(g-1)/g m/B_i + 2(N-1) alpha_e + 2(N-1)/N m/B_e``."""
    if nodes * per_node <= 1 or m <= 0:
        return 0.0
    within = 0.0
    if per_node > 1:
        within = 2 * (per_node - 1) * intra.step_s(m / per_node)
    between = ring_allreduce(m, nodes, inter)
    return overhead_s + within + between


def byteps(m: float, n: int, k: int, link: Link, overhead_s: float = 0.0) -> float:
    """BytePS's communication time (Jiang et al., OSDI 2020, section 3.2) for ``n`` worker
    machines that also sum (colocated) and ``k`` extra CPU server machines, all on links of
    bandwidth ``B``: ``2n(n-1) m / ((n^2 + kn - 2k) B)`` plus one push and one pull latency.
    ``k = 0`` is the ring's bandwidth term, ``k = n`` gives ``m/B``."""
    if n <= 1 and k == 0:
        return 0.0
    if n <= 1:
        return overhead_s + 2 * link.latency_s + m / link.bytes_per_s
    return overhead_s + 2 * link.latency_s + \
        2 * n * (n - 1) * m / ((n * n + k * n - 2 * k) * link.bytes_per_s)


def dedicated_ps(m: float, n: int, servers: int, worker: Link, server: Link,
                 sum_bytes_per_s: float = 0.0, overhead_s: float = 0.0,
                 share: float | None = None, chunk: float = 0.0) -> float:
    """hvdtrain's dedicated parameter servers (``ps.placement=dedicated``): each of ``n`` workers
    pushes ``m`` and pulls ``m`` at once (full duplex); the busiest server holds ``share`` of the
    vector (``1/S`` when the chunks' hashes spread evenly), receives and sends ``n m share`` and
    sums it at ``R`` bytes/s; the pulls follow the pushes chunk by chunk, so the last chunk's
    (``chunk`` bytes) leaves after the last push: ``2 alpha + max(m/B_w, n m share/B_s) +
    n chunk/B_s + n m share/R`` (:mod:`hvdtrain.ps.client`; the sum is added, as the chunks
    pipeline it behind the transfers only in part)."""
    if servers < 1:
        raise ValueError("dedicated parameter servers need at least one server")
    share = 1.0 / servers if share is None else share
    transfer = max(m / worker.bytes_per_s, n * m * share / server.bytes_per_s)
    tail = pull_tail(m, n, server, chunk)
    summing = n * m * share / sum_bytes_per_s if sum_bytes_per_s > 0 else 0.0
    return overhead_s + worker.latency_s + server.latency_s + transfer + tail + summing


def pull_tail(m: float, n: int, server: Link, chunk: float) -> float:
    """The last chunk's pull, which leaves a server once the last push has arrived: ``n c/B_s``
    (``c`` the chunk's bytes, at most ``m``)."""
    return n * min(chunk, m) / server.bytes_per_s


def send(m: float, link: Link, overhead_s: float = 0.0) -> float:
    """One point-to-point message of ``m`` bytes: ``alpha + m/B`` (pipeline stage to stage)."""
    return overhead_s + link.latency_s + m / link.bytes_per_s if m > 0 else 0.0
