"""``hvdtrain plan calibrate`` through Horovod's PyTorch ops: broadcast and allreduce sweeps
among the job's ranks, timed on rank 0, turned into a cluster file by
:mod:`hvdtrain.plan.calibrate`."""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch
import yaml

from hvdtrain.errors import ConfigError
from hvdtrain.horovod_start import start_horovod
from hvdtrain.plan.calibrate import REPEATS, SIZES, Sweep, cluster_tree


def _timed(op: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``op`` over ``repeats`` runs after one untimed, each run started by every
    rank together (a barrier), so that no rank's late start counts as the link's time."""
    op()
    times = []
    for _ in range(repeats):
        hvd.barrier()
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sweep(sizes: Sequence[int] = SIZES, repeats: int = REPEATS) -> Sweep:
    """The sweep among the job's ranks (every rank calls it)."""
    bcast, allred = [], []
    for size in sizes:
        buf = torch.ones(size // 4)

        def broadcast(b: torch.Tensor = buf, s: int = size) -> Any:
            return hvd.broadcast(b, 0, name=f"cal.b.{s}")

        def allreduce(b: torch.Tensor = buf, s: int = size) -> Any:
            return hvd.allreduce(b, name=f"cal.a.{s}")
        bcast.append(_timed(broadcast, repeats))
        allred.append(_timed(allreduce, repeats))
    # Rank 0's figures for every rank: the file is one, whichever rank writes it.
    bcast_s, allred_s = hvd.broadcast_object((tuple(bcast), tuple(allred)), root_rank=0)
    return Sweep(tuple(sizes), bcast_s, allred_s, ranks=hvd.size())


def calibrate(out: str | Path, sizes: Sequence[int] = SIZES, repeats: int = REPEATS) -> bool:
    """Measures the link among the job's ranks; rank 0 writes the cluster file and gets True."""
    start_horovod(hvd, 0.0)
    if hvd.size() < 2:
        raise ConfigError("hvdtrain plan calibrate: needs at least 2 ranks (horovodrun -np N, "
                          "one per host to measure the link between hosts), not 1")
    hosts = hvd.allgather_object(socket.gethostname())
    controller = "mpi" if hvd.mpi_enabled() else "gloo"
    tree = cluster_tree(sweep(sizes, repeats), hosts, hvd.local_size(), controller)
    if hvd.rank() == 0:
        Path(out).write_text("# Written by hvdtrain plan calibrate (docs/planner.md)\n"
                             + yaml.safe_dump(tree, sort_keys=False))
    return hvd.rank() == 0
