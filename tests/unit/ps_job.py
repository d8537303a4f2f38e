"""A parameter-server job without any framework: real servers (through ``hvdtrain.driver.train``,
as ``hvdtrain train`` runs them) and workers that drive the real client with known vectors.

Usage (under mpirun): ps_job.py MODE OUT SERVERS [COMPRESSION]
- ``sum``: workers push 3 steps of vectors made from their rank and check the sums they pull;
  every rank writes OUT/rank<r>.json (its role, the modules it imported, what it checked).
- ``hang``: the server stops itself (SIGSTOP) instead of serving: the workers must give up after
  ``ps.timeout_s`` with the one-line error that names it.
- ``die``: the server kills itself (SIGKILL): the job must end, naming it.
- ``fail``: every rank trains a config whose dataset does not exist, through the driver: the
  workers fail before their first message to the servers, and the job must still end.
"""

import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np

from hvdtrain.config import load_config
from hvdtrain.driver import train
from hvdtrain.errors import HvdtrainError
from hvdtrain.ps.exchange import make_client
from hvdtrain.ps.world import end_job_at_exit, split

SHAPES = [(1000,), (37, 11)]  # 1,407 elements: 6 chunks of 1 KiB over the servers
FRAMEWORKS = ("torch", "tensorflow", "keras", "horovod")


def worker(world, cfg, out: Path) -> dict:
    client = make_client(cfg.ps, cfg.comm, SHAPES)
    workers = len(world.worker_ranks)
    total = client.layout.total
    errors = []
    for step in range(3):
        base = np.arange(total, dtype=np.float32) % 64  # small integers: exact in float16 too
        flat = (base * (world.rank + 1) + step).astype(np.float32)
        summed = client.push_pull(flat).astype(np.float32)
        expected = sum(base * (r + 1) + step for r in range(workers))
        errors.append(float(np.abs(summed - expected).max()))
    client.finish()
    owned = [len(client.layout.owned(s)) for s in range(len(world.servers))]
    return {"role": "worker", "errors": errors, "owned": owned,
            "pushed": client.pushed_bytes, "pulled": client.pulled_bytes}


def main() -> None:
    mode, out, servers = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    compression = sys.argv[4] if len(sys.argv) > 4 else "none"
    cfg = load_config(None, ["comm.topology=ps", f"ps.servers={servers}", "ps.chunk_kib=1",
                             f"comm.compression={compression}",
                             "ps.timeout_s=3", f"log.dir={out}"], environ={})
    world = split(servers)
    if mode == "fail":
        try:
            train(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, name="nope")))
        except HvdtrainError as exc:  # as the CLI prints it; the driver ends the job at exit
            print(f"hvdtrain: error: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
    if world.is_server:
        if mode in ("hang", "die"):  # before serving: the workers' first pull finds no server
            os.kill(os.getpid(), signal.SIGSTOP if mode == "hang" else signal.SIGKILL)
        record = {"role": "server", "served": train(cfg).summary["steps_served"]}
    else:
        try:
            record = worker(world, cfg, out)
        except HvdtrainError as exc:  # as the driver and the CLI handle it
            end_job_at_exit(world, exc)
            print(f"hvdtrain: error: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
    record["modules"] = sorted(m for m in FRAMEWORKS if m in sys.modules)
    (out / f"rank{world.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
