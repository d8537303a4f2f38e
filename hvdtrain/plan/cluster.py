"""The cluster file: nodes, ranks per node, the links within and between nodes, optional CPU server
nodes, and each rank's compute speed relative to the machine the model was profiled on.

```yaml
nodes: 32                 # compute nodes
ranks_per_node: 4         # ranks (GPUs) per node
compute_speed: 1.0        # a rank's speed relative to the profiling machine (2.0: twice as fast)
intra: {bandwidth_gbit_s: 80, latency_us: 2}    # the link between ranks of one node
inter: {bandwidth_gbit_s: 25, latency_us: 5}    # each node's link to the others (its NIC)
servers: {nodes: 0, bandwidth_gbit_s: 25, latency_us: 5, sum_gbyte_s: 0}
message_overhead_us: 0    # fixed cost per collective call (Horovod's negotiation, launches)
memory_gib: 0             # memory a rank may use, GiB (0: not checked)
```

Every key is checked as the run config's are (:func:`hvdtrain.config.build`): a missing, unknown or
impossible value is one :class:`~hvdtrain.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hvdtrain.config import _opt, build
from hvdtrain.errors import ConfigError, os_failure
from hvdtrain.plan.calibrate import Sweep, step_excess

REQUIRED = ("nodes", "ranks_per_node", "intra", "inter")
"""Top-level keys a cluster file must give: no default would describe a real cluster."""
LINK_REQUIRED = ("bandwidth_gbit_s", "latency_us")


@dataclass(kw_only=True)
class Link:
    """One kind of link: its bandwidth each way and its one-way latency."""

    bandwidth_gbit_s: float = _opt(0.0, min=0.0)
    """Bandwidth each way, Gbit/s (10**9 bits per second), as the collectives reach it."""
    latency_us: float = _opt(0.0, min=0.0)
    """One-way latency of one message, microseconds (the alpha of the alpha-beta model)."""
    excess: tuple[tuple[float, float], ...] = field(default=(), init=False, repr=False)
    """``(chunk bytes, seconds)``: what a ring step of that chunk took beyond the alpha-beta model
    where ``hvdtrain plan calibrate`` measured this link (:func:`~hvdtrain.plan.calibrate.step_excess`);
    set from the file's ``calibration``, not a key of its own."""

    @property
    def bytes_per_s(self) -> float:
        """Bandwidth in bytes per second."""
        return self.bandwidth_gbit_s * 1e9 / 8

    @property
    def latency_s(self) -> float:
        """Latency in seconds."""
        return self.latency_us * 1e-6

    def step_s(self, chunk: float) -> float:
        """One ring step that moves ``chunk`` bytes each way: ``alpha + c/B`` plus the calibrated
        excess at ``c`` (interpolated between the measured chunks from 0 at none, the largest
        measured chunk's beyond it)."""
        return self.latency_s + chunk / self.bytes_per_s + _interpolate(self.excess, chunk)

    def shared(self, by: int) -> Link:
        """This link shared by ``by`` equal flows, as one of them sees it: ``B/by``, and the
        excess of a step ``by`` times the chunk."""
        link = Link(bandwidth_gbit_s=self.bandwidth_gbit_s / by, latency_us=self.latency_us)
        link.excess = tuple((c / by, e) for c, e in self.excess)
        return link


def _interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise linear through ``(0, 0)`` and ``points`` (ascending x), flat beyond the last."""
    x0, y0 = 0.0, 0.0
    for x1, y1 in points:
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
        x0, y0 = x1, y1
    return y0


@dataclass(kw_only=True)
class Servers:
    """CPU machines that only serve parameters (no rank trains on them)."""

    nodes: int = _opt(0, min=0)
    """Server machines (0: none; parameter-server settings that need them are not applicable)."""
    bandwidth_gbit_s: float = _opt(0.0, min=0.0)
    """A server's link, Gbit/s each way (required when ``nodes`` > 0)."""
    latency_us: float = _opt(0.0, min=0.0)
    """A server's one-way latency, microseconds."""
    sum_gbyte_s: float = _opt(0.0, min=0.0)
    """The rate a server sums gradients at, GB/s (0: summing never limits)."""

    @property
    def link(self) -> Link:
        """The servers' link."""
        return Link(bandwidth_gbit_s=self.bandwidth_gbit_s, latency_us=self.latency_us)


@dataclass(kw_only=True)
class Cluster:
    """A cluster as the planner sees it."""

    nodes: int = _opt(1, min=1)
    """Compute nodes; the plan predicts for 1 to this many."""
    ranks_per_node: int = _opt(1, min=1)
    """Ranks (GPUs, or processes) per node."""
    compute_speed: float = _opt(1.0, min=0.0)
    """A rank's compute speed relative to the machine the profile was measured on."""
    intra: Link = field(default_factory=Link)
    """The link between two ranks of one node."""
    inter: Link = field(default_factory=Link)
    """A node's link to the network (shared by its ranks)."""
    servers: Servers = field(default_factory=Servers)
    """Optional CPU server nodes for parameter servers."""
    message_overhead_us: float = _opt(0.0, min=0.0)
    """Fixed cost of each collective call, microseconds, on top of the links' latency."""
    memory_gib: float = _opt(0.0, min=0.0)
    """The memory one rank may use, GiB (2**30 bytes): a GPU's, or a node's divided by its ranks
    (0: not given, no setting is checked). A setting whose rank needs more
    (:mod:`hvdtrain.plan.memory`) is not applicable at that node count."""
    name: str = ""
    """A name for the tables (default: the file's stem)."""
    calibration: dict = _opt({})
    """What ``hvdtrain plan calibrate`` measured (hosts, ranks, sizes, seconds, the link
    ``measured``): the plan adds each ring step's excess over the alpha-beta model at the sweep's
    sizes to that link (:attr:`Link.excess`)."""

    def __post_init__(self) -> None:
        checks = [
            (self.compute_speed > 0, "compute_speed", self.compute_speed, "must be > 0"),
            (self.inter.bandwidth_gbit_s > 0, "inter.bandwidth_gbit_s",
             self.inter.bandwidth_gbit_s, "must be > 0"),
            (self.ranks_per_node == 1 or self.intra.bandwidth_gbit_s > 0,
             "intra.bandwidth_gbit_s", self.intra.bandwidth_gbit_s,
             "must be > 0 with more than one rank per node"),
            (not self.servers.nodes or self.servers.bandwidth_gbit_s > 0,
             "servers.bandwidth_gbit_s", self.servers.bandwidth_gbit_s,
             "must be > 0 with server nodes"),
        ]
        for ok, key, value, why in checks:
            if not ok:
                raise ConfigError(f"cluster key {key}={value!r}: {why}")
        if self.calibration:
            link = self.inter if self.calibration.get("measured", "inter") == "inter" else self.intra
            try:
                link.excess = step_excess(_sweep_of(self.calibration))
            except ValueError as exc:  # a sweep link_of cannot fit
                raise ConfigError(f"cluster key calibration.allreduce_s: {exc}") from None

    @property
    def overhead_s(self) -> float:
        """:attr:`message_overhead_us` in seconds."""
        return self.message_overhead_us * 1e-6

    def to_dict(self) -> dict[str, Any]:
        """The cluster as plain data (the JSON output echoes it)."""
        import dataclasses

        return dataclasses.asdict(self)


def _sweep_of(record: dict) -> Sweep:
    """The :class:`Sweep` a ``calibration`` record holds; a missing or impossible value is one
    error naming its key."""
    for key in ("ranks", "sizes", "broadcast_s", "allreduce_s"):
        if key not in record:
            raise ConfigError(f"cluster key calibration.{key}: missing (the record "
                              "hvdtrain plan calibrate writes has it)")
    ranks, sizes, seconds = record["ranks"], record["sizes"], record["allreduce_s"]
    if not isinstance(ranks, int) or ranks < 2:
        raise ConfigError(f"cluster key calibration.ranks={ranks!r}: must be an integer >= 2")
    if record.get("measured", "inter") not in ("inter", "intra"):
        raise ConfigError(f"cluster key calibration.measured={record['measured']!r}: "
                          "must be inter or intra")
    lists = [record[k] for k in ("sizes", "broadcast_s", "allreduce_s")]
    numbers = all(isinstance(v, list) for v in lists) and all(
        isinstance(x, (int, float)) and x >= 0 for v in lists for x in v)
    rising = numbers and all(a < b for a, b in itertools.pairwise(sizes))
    if not rising or len({len(v) for v in lists}) != 1 or len(sizes) < 3:
        raise ConfigError("cluster key calibration.sizes / broadcast_s / allreduce_s: must be "
                          "lists of at least 3 numbers >= 0 of one length, the sizes rising")
    return Sweep(tuple(sizes), tuple(record["broadcast_s"]), tuple(seconds), ranks)


def cluster_from_tree(tree: Any, where: str = "cluster file") -> Cluster:
    """A :class:`Cluster` from parsed YAML, every key checked; one-line errors name the key."""
    if not isinstance(tree, dict):
        raise ConfigError(f"{where}: expected a mapping of keys at the top")
    for key in REQUIRED:
        if key not in tree:
            raise ConfigError(f"{where}: missing key {key!r} (required: {', '.join(REQUIRED)})")
    for section in ("intra", "inter"):
        value = tree[section]
        missing = [k for k in LINK_REQUIRED if not isinstance(value, dict) or k not in value]
        if isinstance(value, dict) and missing:
            raise ConfigError(f"{where}: missing key {section}.{missing[0]!r}")
    return build(Cluster, tree)


def load_cluster(path: str | Path) -> Cluster:
    """Reads and checks a cluster file; the name defaults to the file's stem."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"cluster file {str(path)!r} not found")
    try:
        tree = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise os_failure(exc, "cannot read the cluster file", path, "check its permissions") from None
    except (yaml.YAMLError, ValueError) as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    cluster = cluster_from_tree(tree, f"cluster file {path}")
    cluster.name = cluster.name or path.stem
    return cluster
