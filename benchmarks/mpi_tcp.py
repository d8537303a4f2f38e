"""Open MPI over TCP in both directions: its emulated put, and its allreduce algorithm.

On ``scripts/cluster_local.sh``'s nodes at 100 Mbit/s a link (started here, stopped at the end;
needs root), with mpi4py and Horovod as hvdtrain's ranks run them:

- a 17.4 MB message between two nodes, one way and both ways at once (each rank posts its receive,
  then its send), with Open MPI's TCP flags as shipped (``put`` on) and without ``put``
  (:data:`hvdtrain.horovod_start.TCP_FLAGS`, hvdtrain's default);
- Horovod's allreduce of 17.4 MB over 4 nodes under MPI: Open MPI's own choice of algorithm with
  and without ``put``, and its ring algorithm (``coll_tuned_allreduce_algorithm=4``);
- the two-node exchange again on unshaped links (veth at memory speed), where turning ``put``
  off must not cost.

Each figure is the median of four transfers in one job, beside the bound M/B (one message) or
2(n-1)/n M/B (the ring's). Usage (from the repository root; about 3 minutes)::

    .venv/bin/python benchmarks/mpi_tcp.py
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import harness
import ps_links
from hvdtrain.horovod_start import TCP_FLAGS

ELEMENTS = ps_links.PARAMS
RATE = "100mbit"
WITH_PUT = "send,put,inplace,need-ack,need-csum,hetero-rdma"
"""Open MPI 4.1's default ``btl_tcp_flags``."""
REPEATS = 4
ME = [str(harness.python()), __file__]
"""This script as the ranks run it: its worker modes are ``exchange`` and ``allreduce``."""


def exchange_worker() -> None:
    """Rank 0 and 1: one way (0 to 1) and both ways, alternately; rank 0 prints the medians."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    peer = 1 - comm.rank
    send, recv = np.ones(ELEMENTS, np.float32), np.empty(ELEMENTS, np.float32)
    times: dict[str, list[float]] = {"one": [], "both": []}
    for _ in range(REPEATS):
        for way in times:
            comm.Barrier()
            start = time.perf_counter()
            requests = []
            if way == "both" or comm.rank == 1:
                requests.append(comm.Irecv(recv, peer, 0))
            if way == "both" or comm.rank == 0:
                requests.append(comm.Isend(send, peer, 0))
            MPI.Request.Waitall(requests)
            comm.Barrier()
            times[way].append(time.perf_counter() - start)
    if comm.rank == 0:
        print("RESULT", statistics.median(times["one"]), statistics.median(times["both"]),
              flush=True)


def allreduce_worker() -> None:
    """Every rank: Horovod's allreduce of the gradient's size; rank 0 prints the median."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    tensor = torch.ones(ELEMENTS)
    hvd.allreduce(tensor, name="warm-up")
    times = []
    for i in range(REPEATS):
        hvd.allreduce(torch.zeros(1), name=f"barrier{i}")
        start = time.perf_counter()
        hvd.allreduce(tensor, name=f"timed{i}")
        times.append(time.perf_counter() - start)
    if hvd.rank() == 0:
        print("RESULT", statistics.median(times), flush=True)


def launch(argv: Sequence[str], env: dict[str, str]) -> list[float]:
    """Runs ``argv`` with the cluster's ssh first on PATH; the numbers of its RESULT line."""
    full = {**os.environ, "PATH": f"{ps_links.CLUSTER_DIR / 'bin'}{os.pathsep}"
            f"{os.environ['PATH']}", **env}
    proc = subprocess.run(argv, env=full, capture_output=True, text=True, timeout=600)
    # The launcher's rank tags may follow the numbers on the same line.
    found = re.findall(r"RESULT((?:[ \t]+[-+.\deE]+)+)", proc.stdout)
    if proc.returncode != 0 or not found:
        raise harness.BenchError(f"{' '.join(argv)}: exit {proc.returncode}\n"
                                 f"{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    return [float(v) for v in found[-1].split()]


def exchanges(bound: float | None) -> list[list[str]]:
    """Rows of the two-node exchange with put on and off; ``bound``: M/B, or None unshaped."""
    link = "100 Mbit/s" if bound else "unshaped"
    rows = []
    for name, flags in (("put on (Open MPI's default)", WITH_PUT),
                        ("put off (hvdtrain's default)", TCP_FLAGS)):
        one, both = launch(["mpirun", "-np", "2", "-H", "node1:1,node2:1", "--mca",
                            "btl_tcp_if_include", ps_links.IFACE, *ME, "exchange"],
                           {"OMPI_MCA_btl_tcp_flags": flags})
        for way, seconds in (("one way", one), ("both ways", both)):
            rows.append([f"2 nodes, {link}, 17.4 MB {way}, {name}", f"{seconds:.3f}",
                         f"{bound:.3f}" if bound else "—",
                         f"{seconds / bound:.2f}" if bound else "—"])
    return rows


def measure() -> list[list[str]]:
    """The table's rows: at 100 Mbit/s, then the exchange on unshaped links."""
    rows = exchanges(4 * ELEMENTS / (ps_links.RATES[RATE] / 8))
    ring = ps_links.ring_s(4, ps_links.RATES[RATE] / 8)
    for name, env in (("Open MPI's choice, put on", {"OMPI_MCA_btl_tcp_flags": WITH_PUT}),
                      ("Open MPI's choice, put off", {"OMPI_MCA_btl_tcp_flags": TCP_FLAGS}),
                      ("ring algorithm, put off", {"OMPI_MCA_btl_tcp_flags": TCP_FLAGS,
                                                   **ps_links.MPI_RING})):
        (seconds,) = launch([harness.horovodrun(), "-np", "4", "-H",
                             "node1:1,node2:1,node3:1,node4:1", "--mpi", "--network-interfaces",
                             ps_links.IFACE, *ME, "allreduce"], env)
        rows.append([f"4 nodes, Horovod allreduce of 17.4 MB, {name}", f"{seconds:.3f}",
                     f"{ring:.3f}", f"{seconds / ring:.2f}"])
    ps_links.cluster("start", "4", "--bandwidth", "none")
    return rows + exchanges(None)


def main(argv: Sequence[str] | None = None) -> int:
    """Measures, prints the section and, unless ``--no-write``, writes it."""
    p = harness.parser("mpi_tcp.py", __doc__.splitlines()[0], {}, timeout=600.0)
    args = harness.parse(p, argv)
    machine = harness.machine_record()
    ps_links.cluster("start", "4", "--bandwidth", RATE)
    try:
        rows = measure()
    finally:
        ps_links.cluster("stop")
    grid = harness.markdown_grid(["transfer", "median s", "bound s", "x bound"], rows)
    both_on, both_off = float(rows[1][3]), float(rows[3][3])
    verdict = (f"no target; both ways at once {both_on:.2f} x the one-message bound with put, "
               f"{both_off:.2f} x without; Horovod's allreduce {rows[4][3]} x the ring's bound "
               f"(Open MPI's choice, put on), {rows[5][3]} x (put off), {rows[6][3]} x (ring)")
    notes = ["Bounds: M/B for one message; the ring's 2(n-1)/n M/B for the allreduce "
             f"(M = {4 * ELEMENTS / 1e6:.1f} MB, B = 100 Mbit/s).",
             "hvdtrain starts every rank without put (`hvdtrain.horovod_start.open_mpi_defaults`, "
             "unless `OMPI_MCA_btl_tcp_flags` is set); Open MPI's allreduce algorithm is left to "
             "Open MPI (force the ring with `OMPI_MCA_coll_tuned_use_dynamic_rules=1 "
             "OMPI_MCA_coll_tuned_allreduce_algorithm=4`, as benchmarks/ps_links.py does)."]
    entry = harness.Entry(label="Open MPI over TCP in both directions", script="mpi_tcp.py",
                          target="none (a comparison)",
                          verdict=verdict)
    harness.publish(harness.section_text("Open MPI over TCP in both directions", args.command,
                                         machine, [grid], notes, entry=entry), args)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["exchange"]:
        exchange_worker()
    elif sys.argv[1:] == ["allreduce"]:
        allreduce_worker()
    else:
        sys.exit(main())
