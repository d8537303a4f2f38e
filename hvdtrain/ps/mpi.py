"""The MPI communicators of a job with dedicated servers (``ps.placement=dedicated``), made once
per process from the layout of ranks (:class:`hvdtrain.layout.Layout`).

The layout puts the servers on the job's last ``ps.servers`` ranks; ``MPI.COMM_WORLD`` is split
so that the others train in a Horovod world of their own (``hvd.init(comm=workers)``), so worker
rank 0 is rank 0 of the job and writes the run directory, and every Horovod collective
(gradients, metrics, broadcasts) runs among workers only. Servers get ``MPI.UNDEFINED`` from the
split and never import a framework or Horovod.

mpi4py is imported here, before any Horovod starts: it initialises MPI with
``MPI_THREAD_MULTIPLE``, which Horovod's background thread beside the point-to-point traffic of
the main thread needs. Importing mpi4py requires an MPI launch (``horovodrun --mpi``, ``mpirun``,
``srun --mpi=pmix``); under horovodrun's Gloo controller every process would be an MPI world of
its own, so that is refused first.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdtrain.config import Config, PSConfig
from hvdtrain.errors import EnvironmentFailure, HvdtrainError
from hvdtrain.horovod_start import open_mpi_defaults
from hvdtrain.layout import Layout, dedicated

_HOST_BYTES = 256


@dataclass(frozen=True)
class PSWorld:
    """This process's place in a job with dedicated servers: the job's layout of ranks and the
    communicators made from it."""

    comm: Any
    """``MPI.COMM_WORLD``: servers and workers talk point-to-point on it."""
    workers: Any
    """The workers' communicator (Horovod's world), or None on a server."""
    rank: int
    """This process's rank in the job."""
    layout: Layout
    """Which ranks serve and which train."""
    hosts: tuple[str, ...]
    """Every rank's host name, by rank in the job (for error messages)."""

    @property
    def size(self) -> int:
        """Ranks in the job, servers included."""
        return self.layout.size

    @property
    def servers(self) -> tuple[int, ...]:
        """The servers' ranks in the job, in server order."""
        return tuple(self.layout.server_ranks())

    @property
    def is_server(self) -> bool:
        """Whether this process serves."""
        return self.layout.is_server(self.rank)

    @property
    def server_index(self) -> int:
        """This server's index (0 .. S - 1)."""
        return self.layout.server_index(self.rank)

    @property
    def worker_ranks(self) -> tuple[int, ...]:
        """The workers' ranks in the job (worker i is rank i)."""
        return tuple(self.layout.worker_ranks())

    def name(self, rank: int) -> str:
        """``server 1 (rank 3 on host node2)`` or ``worker 0 (rank 0 on host node1)``."""
        role = (f"server {self.layout.server_index(rank)}" if self.layout.is_server(rank)
                else f"worker {rank}")  # worker i is rank i
        return f"{role} (rank {rank} on host {self.hosts[rank]})"


_WORLD: PSWorld | None = None


def gloo_controller(environ: Mapping[str, str]) -> bool:
    """Whether horovodrun started this process with its Gloo controller."""
    return environ.get("HOROVOD_CONTROLLER") == "gloo" or "HOROVOD_GLOO_RENDEZVOUS_ADDR" in environ


def split(servers: int, environ: Mapping[str, str] = os.environ) -> PSWorld:
    """This process's :class:`PSWorld`: the last ``servers`` ranks serve. The first call is a
    collective of every rank in the job; later calls return the same split (a process starts
    Horovod once, so its world cannot change)."""
    global _WORLD
    if _WORLD is None:
        _WORLD = _split(servers, environ)
    elif len(_WORLD.servers) != servers:
        raise HvdtrainError(f"ps.servers={servers}: this process already split its job with "
                            f"{len(_WORLD.servers)} server(s); one process keeps one split")
    return _WORLD


def _split(servers: int, environ: Mapping[str, str]) -> PSWorld:
    if gloo_controller(environ):
        raise HvdtrainError("comm.topology=ps with ps.placement=dedicated needs MPI between "
                            "workers and servers: launch with horovodrun --mpi (or mpirun, or "
                            "srun --mpi=pmix), not --gloo")
    open_mpi_defaults(os.environ)
    from mpi4py import MPI  # initialises MPI (thread level MULTIPLE) before Horovod does

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    layout = Layout(size=world.Get_size(), servers=servers)  # refuses a job of servers only
    color = MPI.UNDEFINED if layout.is_server(rank) else 0
    workers = world.Split(color, rank)
    return PSWorld(comm=world, workers=None if workers == MPI.COMM_NULL else workers,
                   rank=rank, layout=layout, hosts=_hosts(world))


def _hosts(world: Any) -> tuple[str, ...]:
    """Every rank's host name, gathered as fixed-size bytes (no pickles cross the job)."""
    from mpi4py import MPI

    own = np.zeros(_HOST_BYTES, np.uint8)
    name = MPI.Get_processor_name().encode()[:_HOST_BYTES]
    own[:len(name)] = np.frombuffer(name, np.uint8)
    every = np.zeros((world.Get_size(), _HOST_BYTES), np.uint8)
    world.Allgather(own, every)
    return tuple(bytes(row).rstrip(b"\0").decode(errors="replace") for row in every)


def exit_code(exc: BaseException) -> int:
    """The code ``hvdtrain train`` exits with for ``exc`` (docs/elastic.md, "Exit codes")."""
    if isinstance(exc, (EnvironmentFailure, OSError)):
        return 74
    return 2 if isinstance(exc, HvdtrainError) else 1


def end_job_at_exit(world: PSWorld, exc: BaseException) -> None:
    """Ends the whole job when this worker's process exits after ``exc``.

    A worker that leaves its training on an error would otherwise hang at exit: ``MPI_Finalize``
    waits for every rank, and the servers wait for that worker's next message forever. So once
    the error has been reported (the CLI prints it), ``MPI_Abort`` with the CLI's exit code
    ends every rank. Registered after mpi4py's own exit handler, it runs before that one.
    """
    atexit.register(world.comm.Abort, exit_code(exc))


def horovod_comm(cfg: Config) -> Any:
    """The communicator Horovod starts on (``hvd.init(comm=...)``): the workers' with dedicated
    servers, else None (Horovod's own world)."""
    return split(cfg.ps.servers).workers if dedicated(cfg) else None


def ps_settings(cfg: Config) -> PSConfig | None:
    """The ``ps`` section where ``cfg`` trains with parameter servers, else None: what the
    engines hand their ``make_exchange``."""
    return cfg.ps if cfg.comm.topology == "ps" else None
