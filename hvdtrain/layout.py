"""The layout of a job's ranks: one arrangement, decided once from the config and the world size.

Every way of spreading a training over ranks reads this one layout; nothing else computes which
rank does what. A job of ``size`` ranks holds, in this order of dimensions:

- **servers**: dedicated parameter-server ranks (``comm.topology=ps``,
  ``ps.placement=dedicated``), the job's last ``servers`` ranks. The others are the **workers**,
  worker ``i`` being rank ``i`` of the job, so worker 0 is rank 0, the rank that writes, and the
  workers' Horovod world numbers its ranks as the job does.
- **stages** (``pipeline.stages``): a worker holds stage ``rank % stages`` of one pipeline. A
  pipeline's ranks are consecutive: stage-to-stage tensors travel every micro-batch, so a
  pipeline stays on as few hosts as the launcher's slots allow.
- **shards**: the ranks among which one copy of a stage's parameters is sharded where that group
  is smaller than the stage's data-parallel ranks: ``shard.group=node`` (hybrid sharding) makes
  it the ranks of one node (Horovod's ``local_size``), the copies then being the nodes. Otherwise
  it is 1, and sharded data parallel (``shard.group=all``) shards over the stage's copies.
- **copies**: data-parallel copies of the whole (``workers / (stages x shards)``); with one stage
  and no servers every rank is a copy, as a plain ring run has it.

A worker's rank is ``(copy x shards + shard) x stages + stage``. The groups that talk follow
from the coordinates: a copy's pipeline (:meth:`Layout.pipeline_ranks`: activations and their
gradients between neighbouring stages), a stage's copies (:meth:`Layout.stage_ranks`: the
data-parallel group that averages that stage's gradients, and over which the sharded update
shards its optimizer state), a stage's shards (:meth:`Layout.shard_ranks`), the workers and the
servers. The framework code turns these rank lists into Horovod process sets, torch process
groups or MPI communicators; this module imports no framework and no feature package.

A new dimension (tensor or context parallelism) is one more field here, one more coordinate, its
place in the rank formula and the groups it forms; the readers keep asking for groups by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hvdtrain.errors import ConfigError, HvdtrainError

if TYPE_CHECKING:
    from hvdtrain.config import Config

WORKER = "worker"
SERVER = "server"


@dataclass(frozen=True)
class Coordinates:
    """Where one rank stands in a :class:`Layout`: a worker's stage, copy and shard, or a
    server's index among the servers (the other fields are None on each side)."""

    role: str
    """:data:`WORKER` or :data:`SERVER`."""
    stage: int | None = None
    copy: int | None = None
    shard: int | None = None
    server: int | None = None


def dedicated(cfg: Config) -> bool:
    """Whether ``cfg`` trains with dedicated server processes."""
    return cfg.comm.topology == "ps" and cfg.ps.placement == "dedicated"


def hybrid(cfg: Config) -> bool:
    """Whether ``cfg`` shards within a node and replicates across nodes (``shard.group=node``)."""
    return cfg.shard.stage >= 1 and cfg.shard.group == "node"


def check_nodes(places: Sequence[tuple[int, int, int]]) -> int:
    """The ranks a node of ``places`` (each rank's ``(local_rank, local_size, cross_rank)``, by
    rank, as Horovod reports them) holds, for ``shard.group=node``: every node must hold as many
    ranks, consecutive ranks on one node (as horovodrun, mpirun ``--map-by slot`` and Slurm's
    block distribution place them), so that a node's ranks are one copy's shards."""
    sizes = sorted({size for _, size, _ in places})
    if len(sizes) > 1:
        raise ConfigError(f"shard.group=node with {sizes} ranks on different nodes: launch the "
                          "same number of ranks on every node, or use shard.group=all")
    size = sizes[0]
    if size == 1:
        raise ConfigError("shard.group=node with one rank a node: there is nothing to shard "
                          "within a node; use shard.group=all")
    for rank, (local, _, cross) in enumerate(places):
        if rank != cross * size + local:
            raise ConfigError(f"shard.group=node: rank {rank} is local rank {local} of node "
                              f"{cross}; place consecutive ranks on one node (horovodrun -H, "
                              "mpirun --map-by slot) or use shard.group=all")
    return size


@dataclass(frozen=True)
class Layout:
    """``size`` ranks: the last ``servers`` serve, the others form ``copies`` copies of a
    pipeline of ``stages`` ranks (each stage split in ``shards``: a node's ranks under
    ``shard.group=node``, else 1)."""

    size: int
    stages: int = 1
    servers: int = 0
    shards: int = 1

    def __post_init__(self) -> None:
        if self.stages < 1 or self.size < 1:
            raise ConfigError(f"pipeline.stages={self.stages} at world size {self.size}: both "
                              "must be at least 1")
        if self.shards < 1:
            raise ValueError(f"shards={self.shards}: a stage is split in at least 1 shard")
        if self.servers < 0:
            raise ValueError(f"servers={self.servers}: a job cannot have fewer than 0 servers")
        if self.servers >= self.size:
            raise HvdtrainError(f"ps.servers={self.servers} with {self.size} rank(s) in the job "
                                "leaves no worker: launch more ranks than servers (e.g. -np "
                                f"{self.servers + 1})")
        per_copy = self.stages * self.shards
        if self.workers % per_copy:
            world = (f"the world size {self.workers}" if not self.servers
                     else f"the {self.workers} workers")
            if self.shards > 1:
                raise ConfigError(f"shard.group=node with {self.shards} ranks a node does not "
                                  f"divide {world}: launch the same number of ranks on every "
                                  "node")
            raise ConfigError(f"pipeline.stages={self.stages} does not divide {world}: launch a "
                              f"multiple of {self.stages} ranks (stages x data-parallel copies)")

    @classmethod
    def of(cls, cfg: Config, workers: int, node_ranks: int = 1) -> Layout:
        """The layout of ``cfg`` whose workers (Horovod's world) are ``workers`` ranks; its
        dedicated servers, if any, come on top as the job's last ranks. ``node_ranks``: the
        ranks of one node (Horovod's ``local_size``), the shards of ``shard.group=node``."""
        servers = cfg.ps.servers if dedicated(cfg) else 0
        shards = node_ranks if hybrid(cfg) else 1
        return cls(size=workers + servers, stages=cfg.pipeline.stages, servers=servers,
                   shards=shards)

    def resized(self, workers: int) -> Layout:
        """The same dimensions at ``workers`` workers (elastic mode's new world)."""
        return Layout(size=workers + self.servers, stages=self.stages, servers=self.servers,
                      shards=self.shards)

    # The dimensions.

    @property
    def workers(self) -> int:
        """Ranks that train (every rank but the servers)."""
        return self.size - self.servers

    @property
    def copies(self) -> int:
        """Data-parallel copies of the pipeline."""
        return self.workers // (self.stages * self.shards)

    def describe(self) -> str:
        """``"2 stages x 2 copies"``: the run summary's ``pipeline`` entry."""
        return f"{self.stages} stages x {self.copies} copies"

    def sharding(self, rank: int) -> tuple[int, int]:
        """``(place, count)``: where worker ``rank`` stands among the ranks its stage's
        parameters are sharded over: its shard of the node's where a copy is split in shards
        (``shard.group=node``), else its copy among the stage's copies (``shard.group=all``)."""
        if self.shards > 1:
            return self.shard_of(rank), self.shards
        return self.copy_of(rank), self.copies

    def sharding_ranks(self, rank: int) -> list[int]:
        """The ranks that ``rank``'s stage's parameters are sharded over (:meth:`sharding`)."""
        if self.shards > 1:
            return self.shard_ranks(self.stage_of(rank), self.copy_of(rank))
        return self.stage_ranks(self.stage_of(rank))

    def replica_ranks(self, rank: int) -> list[int]:
        """The ranks holding the same shard as ``rank`` in the other copies (``shard.group=
        node``: the same local rank on every node), which average that shard's gradient; just
        ``rank`` where the shards span the stage's copies."""
        if self.shards > 1:
            return self.stage_ranks(self.stage_of(rank), self.shard_of(rank))
        return [rank]

    # Coordinates of one rank, and the rank at coordinates.

    def coordinates(self, rank: int) -> Coordinates:
        """Where ``rank`` stands: its role and its place in that role's dimensions."""
        if self.is_server(rank):
            return Coordinates(SERVER, server=self.server_index(rank))
        return Coordinates(WORKER, stage=self.stage_of(rank), copy=self.copy_of(rank),
                           shard=self.shard_of(rank))

    def rank_at(self, where: Coordinates) -> int:
        """The rank at ``where`` (the inverse of :meth:`coordinates`)."""
        if where.role == SERVER and where.server is not None:
            return self.server_rank(where.server)
        if (where.role == WORKER and where.stage is not None and where.copy is not None
                and where.shard is not None):
            return self.rank_of(where.stage, where.copy, where.shard)
        raise ValueError(f"incomplete coordinates {where}")

    def role(self, rank: int) -> str:
        """:data:`SERVER` or :data:`WORKER`."""
        return SERVER if self.is_server(rank) else WORKER

    def is_server(self, rank: int) -> bool:
        """Whether ``rank`` is a dedicated server."""
        return self._in_job(rank) >= self.workers

    def server_index(self, rank: int) -> int:
        """The index (0 .. servers - 1) of server ``rank``."""
        if not self.is_server(rank):
            raise ValueError(f"rank {rank} is a worker, not a server, in {self}")
        return rank - self.workers

    def server_rank(self, index: int) -> int:
        """The rank of server ``index``."""
        if not 0 <= index < self.servers:
            raise ValueError(f"no server {index} in {self}")
        return self.workers + index

    def stage_of(self, rank: int) -> int:
        """The stage that worker ``rank`` holds."""
        return self._worker(rank) % self.stages

    def shard_of(self, rank: int) -> int:
        """The shard of its stage that worker ``rank`` holds."""
        return self._worker(rank) // self.stages % self.shards

    def copy_of(self, rank: int) -> int:
        """The pipeline copy that worker ``rank`` belongs to (its data-parallel replica index)."""
        return self._worker(rank) // (self.stages * self.shards)

    def rank_of(self, stage: int, copy: int, shard: int = 0) -> int:
        """The rank that holds ``shard`` of ``stage`` of ``copy``."""
        if not (0 <= stage < self.stages and 0 <= copy < self.copies
                and 0 <= shard < self.shards):
            raise ValueError(f"no stage {stage} of copy {copy} (shard {shard}) in {self}")
        return (copy * self.shards + shard) * self.stages + stage

    def is_first(self, rank: int) -> bool:
        """Whether ``rank`` holds the first stage (it reads the inputs)."""
        return self.stage_of(rank) == 0

    def is_last(self, rank: int) -> bool:
        """Whether ``rank`` holds the last stage (it reads the targets, computes loss and
        metrics)."""
        return self.stage_of(rank) == self.stages - 1

    def loads_data(self, rank: int) -> bool:
        """Whether ``rank`` reads training data: only the first and last stages do."""
        return self.is_first(rank) or self.is_last(rank)

    # The groups: rank lists the framework code turns into process sets or communicators.

    def worker_ranks(self) -> list[int]:
        """The workers' ranks (worker ``i`` is rank ``i``)."""
        return list(range(self.workers))

    def server_ranks(self) -> list[int]:
        """The servers' ranks, in server order."""
        return list(range(self.workers, self.size))

    def pipeline_ranks(self, copy: int, shard: int = 0) -> list[int]:
        """The ranks of pipeline ``copy`` (of ``shard``), stage 0 first."""
        return [self.rank_of(s, copy, shard) for s in range(self.stages)]

    def stage_ranks(self, stage: int, shard: int = 0) -> list[int]:
        """The ranks holding ``stage`` (its ``shard``), copy 0 first: that stage's data-parallel
        group."""
        return [self.rank_of(stage, c, shard) for c in range(self.copies)]

    def shard_ranks(self, stage: int, copy: int) -> list[int]:
        """The ranks among which ``stage`` of ``copy`` is sharded, shard 0 first."""
        return [self.rank_of(stage, copy, h) for h in range(self.shards)]

    def pipelines(self) -> list[list[int]]:
        """Every pipeline's ranks, copy 0 (shard 0) first."""
        return [self.pipeline_ranks(c, h) for c in range(self.copies) for h in range(self.shards)]

    def stage_groups(self) -> list[list[int]]:
        """Every stage's data-parallel group, stage 0 (shard 0) first."""
        return [self.stage_ranks(s, h) for h in range(self.shards) for s in range(self.stages)]

    def shard_groups(self) -> list[list[int]]:
        """Every stage of every copy's shard group, copy 0 and stage 0 first."""
        return [self.shard_ranks(s, c) for c in range(self.copies) for s in range(self.stages)]

    def _in_job(self, rank: int) -> int:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside a world of {self.size}")
        return rank

    def _worker(self, rank: int) -> int:
        if self.is_server(rank):
            raise ValueError(f"rank {rank} is a server, not a worker, in {self}")
        return rank
