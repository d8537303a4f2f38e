"""Starting Horovod in a rank: its cycle time, Open MPI's yielding, and the compute threads a rank
takes on a host it shares. Framework-free: the engines pass their Horovod module."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

from hvdtrain.errors import HvdtrainError

TCP_FLAGS = "send,inplace,need-ack,need-csum,hetero-rdma"
"""Open MPI's TCP transport flags less ``put``: its emulated put of a large message stalls the
other direction of the same connection, so that an exchange both ways takes the time of the two
one after the other (docs/benchmarks.md, "Open MPI over TCP in both directions")."""


def open_mpi_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """Open MPI settings for the ``MPI_Init`` that follows (``hvd.init()``, or mpi4py's import
    where parameter servers split the job), each unless the user or launcher set it: waiting
    ranks yield the core instead of spinning on it (compute threads already take every core),
    and large TCP messages travel as sends (:data:`TCP_FLAGS`)."""
    environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    environ.setdefault("OMPI_MCA_btl_tcp_flags", TCP_FLAGS)


def set_cycle_time(configured_ms: float, environ: MutableMapping[str, str] = os.environ) -> str:
    """Sets ``HOROVOD_CYCLE_TIME`` (and :func:`open_mpi_defaults`) for the
    ``hvd.init()`` that follows; returns the cycle time in force.

    A configured value (> 0) wins. Otherwise a value the launcher or user already set is kept, and
    else Horovod's own 1 ms holds, whatever the model's size. (A longer cycle for large models
    used to be the default here: on a host whose cores all run compute threads, Horovod's thread
    negotiated every cycle even with nothing to send, and those wake-ups slowed every step. The
    patched build's idle wait, patches/0010, removed that cost, and the shorter cycle starts the
    last allreduce of a step sooner: docs/investigations/step-overhead.md.)
    """
    open_mpi_defaults(environ)
    if configured_ms > 0:
        environ["HOROVOD_CYCLE_TIME"] = f"{configured_ms:g}"
    return environ.get("HOROVOD_CYCLE_TIME", "1")


def start_horovod(hvd: Any, configured_ms: float, process_sets: bool = False,
                  comm: Any = None) -> str:
    """Starts Horovod (``hvd``: ``horovod.torch`` or ``horovod.tensorflow``) with the cycle time
    of :func:`set_cycle_time`; returns the cycle time in force. Horovod starts once per process
    and reads its settings then: where it already runs (a second training in one process),
    nothing is changed.

    ``process_sets``: start with dynamic process sets (``hvd.add_process_set`` after the start;
    pipeline stages average their gradients in one each, and their ranks are known only once
    Horovod runs). Where Horovod already runs without them, that is an error.

    ``comm``: an mpi4py communicator to start on (``hvd.init(comm=...)``), the workers' where
    parameter servers hold the job's last ranks (:func:`hvdtrain.ps.mpi.horovod_comm`); None
    for Horovod's own world. A Horovod already running on another world is refused.
    """
    if not hvd.is_initialized():
        set_cycle_time(configured_ms)
        hvd.init(comm=comm, process_sets="dynamic" if process_sets else None)
    elif process_sets and os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") != "1":
        raise HvdtrainError("Horovod already runs in this process without process sets, which "
                            "pipeline stages need: train with pipeline stages in a new process")
    elif comm is not None and hvd.size() != comm.Get_size():
        raise HvdtrainError(f"Horovod already runs on {hvd.size()} rank(s) in this process; "
                            f"the parameter servers' workers are {comm.Get_size()}: one process "
                            "cannot train on both")
    return os.environ.get("HOROVOD_CYCLE_TIME", "1")


def compute_threads(configured: int, local_size: int) -> int:
    """Compute threads for one rank: ``configured`` when above 0, else the machine's cores divided
    by the ranks on this host, and never more than the cores this process may run on.

    Ranks sharing a host would otherwise each start one thread per core and fight over them. A
    launcher that pins each rank to its cores (``srun --cpu-bind=cores``, ``mpirun --bind-to``)
    has already divided the host: a rank pinned to one core of sixteen that started eight threads
    would run them all on that core.
    """
    if configured > 0:
        return configured
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = (os.cpu_count() or 1) // max(1, local_size)
    return max(1, min(allowed or 1, share))
