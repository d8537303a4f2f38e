"""Hostile messages to a real parameter server (and from a scripted server to a real client), under
mpirun with 2 workers and 1 server: the wire must refuse each with one line naming the sender's
rank and the field, allocate nothing by a size the peer sent, and never hang.

Usage (under mpirun -np 3): ps_wire_job.py OUT

Every case runs on a communicator of its own (``Dup``), so that what one case left unreceived
cannot reach the next: the server rank runs the real :func:`hvdtrain.ps.server.serve` (or, in the
client cases, a script), the worker ranks send scripted messages built by the protocol's own
functions with one field broken (or run the real :class:`hvdtrain.ps.client.PSClient`). Each rank
records what each case raised in OUT/rank<r>.json. Last, the server serves through
``hvdtrain.driver.train`` on the job's own communicator, as ``hvdtrain train`` runs it, and
worker 1 sends a HELLO with ``chunk=0``: the job must end with the server's one line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.config import load_config
from hvdtrain.driver import train
from hvdtrain.errors import HvdtrainError
from hvdtrain.ps import protocol
from hvdtrain.ps.client import PSClient
from hvdtrain.ps.codec import WireSettings, push_scheme
from hvdtrain.ps.layout import ChunkLayout
from hvdtrain.ps.mpi import PSWorld, split
from hvdtrain.ps.server import serve

TOTAL, CHUNK = 1407, 256  # 6 chunks: 5 of 256 elements and one of 127, all on the one server
GOOD = WireSettings()
TOPK = WireSettings("topk", 0.05, True, 512, 200, 0)  # the chunk of 127 travels dense
KEEP: list[Any] = []  # every buffer sent, alive until the job ends (sends are never waited for)


def send(world: PSWorld, message: np.ndarray, tag: int, dest: int = -1) -> None:
    """Sends ``message`` (to the server unless ``dest``), never waiting: the server may refuse
    it unread."""
    KEEP.append(message)
    KEEP.append(world.comm.Isend(protocol.raw(message), dest=world.servers[0] if dest < 0 else dest,
                                 tag=tag))


def hello(world: PSWorld, settings: WireSettings = GOOD, mode: str = "bsp",
          **fields: int) -> np.ndarray:
    """This job's ``HELLO`` (``mode``: the consistency) with ``fields`` (by
    :data:`protocol.HELLO_FIELDS` name) replaced."""
    message = protocol.hello(TOTAL, CHUNK, 1, len(world.worker_ranks), "float32", mode,
                             settings=settings.to_ints())
    for name, value in fields.items():
        message[protocol.HELLO_FIELDS.index(name)] = value
    return message


def pushes(settings: WireSettings, rank: int, bad: str = "") -> list[np.ndarray]:
    """One step's chunks as a ``bsp`` worker pushes them to the one server (descending), each
    codec's buffers; ``bad``: ``short``/``long`` (the first chunk), ``index`` (the first sparse
    chunk's first index -1)."""
    layout, scheme = ChunkLayout(TOTAL, CHUNK, 1), push_scheme(settings)
    out = []
    for chunk in reversed(range(layout.count)):
        start, stop = layout.bounds(chunk)
        codec = scheme.codec(stop - start)
        values = np.arange(start, stop, dtype=np.float32) * (rank + 1)
        out += [np.ascontiguousarray(b) for b in codec.encode(values, 0, chunk, rank)]
    if bad == "short":
        out[0] = out[0][:-1].copy()
    elif bad == "long":
        out[0] = np.zeros(200_000, np.float32)  # 800 kB: far past the eager limit
    elif bad == "index":
        indices = next(b for b in out if b.dtype == np.int32)
        indices[0] = -1
    return out


def bsp_step(world: PSWorld, settings: WireSettings, bad: str = "", **control: int) -> None:
    """A worker's ``HELLO``, one ``CONTROL`` (``control`` replaces its op/step) and pushes."""
    send(world, hello(world, settings), protocol.HELLO)
    send(world, protocol.control(control.get("op", protocol.OP_PUSH), control.get("step", 0)),
         protocol.CONTROL)
    for buffer in pushes(settings, world.rank, bad):
        send(world, buffer, protocol.PUSH)


def hyper(optimizer: float = 0.0) -> np.ndarray:
    """``INIT``'s hyper-parameters: SGD without momentum unless ``optimizer`` says otherwise."""
    return np.array([optimizer, 0.0, 0.0, 0.9, 0.999, 1e-8], np.float64)


def async_start(world: PSWorld, counts: tuple[int, int] = (0, 0), optimizer: float = 0.0) -> None:
    """An ``asp`` worker's ``HELLO`` and, on worker 0, ``INIT``."""
    send(world, hello(world, mode="asp"), protocol.HELLO)
    if world.rank == 0:
        send(world, hyper(optimizer), protocol.INIT)
        send(world, np.array(counts, np.int64), protocol.INIT)
        send(world, np.zeros(TOTAL, np.float32), protocol.INIT)


def async_push(world: PSWorld, op: int = protocol.OP_PUSH, version: int = 0,
               lr: float = 0.1) -> None:
    send(world, protocol.control(op, 0, version, lr), protocol.CONTROL)
    if op == protocol.OP_PUSH:
        send(world, np.ones(TOTAL, np.float32), protocol.PUSH)


def hostile(rank: int, honest: Any, broken: Any) -> dict[int, Any]:
    """Worker ``rank`` runs ``broken``, the other worker ``honest``."""
    return {rank: broken, 1 - rank: honest}


HELLO_CASES = {
    "hello_short": lambda w: send(w, np.arange(3, dtype=np.int64), protocol.HELLO),
    "hello_long": lambda w: send(w, np.zeros(100_000, np.int64), protocol.HELLO),
    "chunk_zero": lambda w: send(w, hello(w, chunk=0), protocol.HELLO),
    "chunk_negative": lambda w: send(w, hello(w, chunk=-256), protocol.HELLO),
    "wire_negative": lambda w: send(w, hello(w, wire=-1), protocol.HELLO),
    "consistency_out_of_range": lambda w: send(w, hello(w, consistency=3), protocol.HELLO),
    "method_negative": lambda w: send(w, hello(w, method=-1), protocol.HELLO),
    "ratio_nan": lambda w: send(w, hello(w, TOPK, ratio=int(np.float64("nan").view(np.int64))),
                                protocol.HELLO),
    "total_negative": lambda w: send(w, hello(w, total=-1), protocol.HELLO),
    "total_too_many_chunks": lambda w: send(w, hello(w, total=2**40, chunk=1), protocol.HELLO),
    "total_disagrees": lambda w: send(w, hello(w, total=2**45, chunk=2**30), protocol.HELLO),
}
CASES: dict[str, dict[int, Any]] = {
    **{name: hostile(1, lambda w: send(w, hello(w), protocol.HELLO), broken)
       for name, broken in HELLO_CASES.items()},
    # Both workers agree on a shard of 2^45 elements: more than any machine here has.
    "total_huge": {r: (lambda w: send(w, hello(w, total=2**45, chunk=2**30), protocol.HELLO))
                   for r in (0, 1)},
    "control_unknown_op": hostile(1, lambda w: bsp_step(w, GOOD), lambda w: bsp_step(w, GOOD, op=99)),
    "control_negative_step": hostile(1, lambda w: bsp_step(w, GOOD),
                                     lambda w: bsp_step(w, GOOD, step=-5)),
    "control_other_step": hostile(1, lambda w: bsp_step(w, GOOD), lambda w: bsp_step(w, GOOD, step=3)),
    "push_short": hostile(1, lambda w: bsp_step(w, GOOD), lambda w: bsp_step(w, GOOD, "short")),
    "push_long": hostile(1, lambda w: bsp_step(w, GOOD), lambda w: bsp_step(w, GOOD, "long")),
    "push_index_negative": hostile(1, lambda w: bsp_step(w, TOPK),
                                   lambda w: bsp_step(w, TOPK, "index")),
    "init_optimizer_negative": hostile(0, async_start, lambda w: async_start(w, optimizer=-1.0)),
    "init_arrays_huge": hostile(0, async_start, lambda w: async_start(w, counts=(0, 2**40))),
    "async_unknown_op": hostile(1, lambda w: (async_start(w), async_push(w)),
                                lambda w: (async_start(w), async_push(w, op=99))),
    "async_load_op": hostile(1, lambda w: (async_start(w), async_push(w)),
                             lambda w: (async_start(w), async_push(w, op=protocol.OP_LOAD))),
    "async_version_ahead": hostile(1, lambda w: async_start(w),
                                   lambda w: (async_start(w), async_push(w, version=7))),
    "async_lr_nan": hostile(1, lambda w: async_start(w),
                            lambda w: (async_start(w), async_push(w, lr=float("nan")))),
}
"""Server cases: what each worker rank sends (the server runs the real ``serve``)."""


def scripted_server(bad: str) -> Any:
    """A server that reads one ``bsp`` step of worker 0 and answers its first pull ``bad``."""
    def run(world: PSWorld) -> None:
        source = world.worker_ranks[0]
        protocol.receive(world, np.zeros(protocol.HELLO_LENGTH, np.int64), source,
                         protocol.HELLO, "HELLO")
        protocol.receive(world, np.zeros(protocol.CONTROL_LENGTH, np.int64), source,
                         protocol.CONTROL, "CONTROL")
        for buffer in pushes(TOPK, 0):  # received into buffers of the same sizes
            protocol.receive(world, buffer, source, protocol.PUSH, "PUSH")
        for buffer in pushes(TOPK, 0, bad):
            send(world, buffer, protocol.PULL, dest=source)
    return run


def real_client(world: PSWorld) -> None:
    """Worker 0's real client: one push and pull, which must refuse the server's answer."""
    client = PSClient(world, TOTAL, CHUNK, timeout_s=60, settings=TOPK)
    client.push_pull(np.arange(TOTAL, dtype=np.float32))


def too_many_chunks(world: PSWorld) -> None:
    """Worker 0's real client for a gradient of 2^30 elements in chunks of 1 KiB: 4 Mi chunks,
    which it refuses before it sends (or allocates) anything."""
    PSClient(world, 2**30, 256, timeout_s=60, settings=TOPK)


CLIENT_CASES = {"pull_short": (scripted_server("short"), real_client),
                "pull_index_negative": (scripted_server("index"), real_client),
                "client_too_many_chunks": (lambda world: None, too_many_chunks)}
"""Client cases: what the server rank runs (a script) and worker 0 (the real client); worker 1
idles."""


def outcome(run: Any, world: PSWorld) -> dict[str, Any]:
    """What ``run(world)`` raised (type and message) or returned."""
    try:
        return {"returned": repr(run(world))}
    except HvdtrainError as exc:
        return {"type": type(exc).__name__, "error": str(exc)}


def main() -> None:
    out = Path(sys.argv[1])
    cfg = load_config(None, ["comm.topology=ps", "ps.servers=1", "ps.chunk_kib=1",
                             "ps.timeout_s=60", f"log.dir={out}"], environ={})
    world = split(1)
    records: dict[str, Any] = {}
    for name, by_rank in CASES.items():
        case = dataclasses.replace(world, comm=world.comm.Dup())
        if world.is_server:
            records[name] = outcome(serve, case)
        elif world.rank in by_rank:
            by_rank[world.rank](case)
        world.comm.Barrier()
    for name, (script, client) in CLIENT_CASES.items():
        case = dataclasses.replace(world, comm=world.comm.Dup())
        if world.is_server:
            script(case)
        elif world.rank == 0:
            records[name] = outcome(client, case)
        world.comm.Barrier()
    (out / f"rank{world.rank}.json").write_text(json.dumps(records))
    world.comm.Barrier()
    # Last, as `hvdtrain train` serves: the job must end with one line (MPI_Abort).
    if world.is_server:
        train(cfg)
    else:
        send(world, hello(world, chunk=0 if world.rank == 1 else CHUNK), protocol.HELLO)
        world.comm.Barrier()  # never returns: the server aborts the job


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001  (a bug of this script: end the job, not hang in Finalize)
        traceback.print_exc()
        sys.stderr.flush()
        split(1).comm.Abort(3)
