"""A parameter-server job without any framework: real servers (through ``hvdtrain.driver.train``,
as ``hvdtrain train`` runs them) and workers that drive the real client with known vectors.

Usage (under mpirun): ps_job.py MODE OUT SERVERS [COMPRESSION [STEPS SAVE_AT [RESUME]]]
- ``sum``: workers push 4 steps of vectors made from their rank and check the sums they pull;
  steps 1 and 3 stream: the vector is written piece by piece, in a random order with pauses,
  while the client already pushes what is complete (``begin``/``filled``/``end``);
  every rank writes OUT/rank<r>.json (its role, the modules it imported, what it checked).
- ``compress``: workers run the ``ps`` exchange over NumPy "gradients" for STEPS steps with
  COMPRESSION (ratio 0.05, chunks under 256 elements dense), gather the residuals of every worker
  and server after step SAVE_AT (worker 0 saves the checkpoint entry as OUT/state.npz) and at the
  end; worker 0 writes its last average (OUT/last.npy) and checks that nothing was lost: the
  pulled sums plus every residual equal the sum of all pushed gradients. RESUME: a state.npz to
  go on from.
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
import time
from pathlib import Path

import numpy as np

from hvdtrain.config import load_config
from hvdtrain.driver import train
from hvdtrain.errors import HvdtrainError
from hvdtrain.ps.exchange import PSExchange, make_client
from hvdtrain.ps.mpi import end_job_at_exit, split

SHAPES = [(1000,), (37, 11)]  # 1,407 elements: 6 chunks of 1 KiB over the servers
FRAMEWORKS = ("torch", "tensorflow", "keras", "horovod")


def worker(world, cfg, out: Path) -> dict:
    client = make_client(cfg.ps, cfg.comm, SHAPES)
    workers = len(world.worker_ranks)
    total = client.layout.total
    errors = []
    rng = np.random.default_rng(world.rank)
    for step in range(4):
        base = np.arange(total, dtype=np.float32) % 64  # small integers: exact in float16 too
        flat = (base * (world.rank + 1) + step).astype(np.float32)
        if step % 2:
            summed = streamed(client, flat, rng).astype(np.float32)
        else:
            summed = client.push_pull(flat).astype(np.float32)
        expected = sum(base * (r + 1) + step for r in range(workers))
        errors.append(float(np.abs(summed - expected).max()))
    client.finish()
    owned = [len(client.layout.owned(s)) for s in range(len(world.servers))]
    return {"role": "worker", "errors": errors, "owned": owned,
            "pushed": client.pushed_bytes, "pulled": client.pulled_bytes}


def streamed(client, flat: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``client``'s sum of ``flat``, written into the client's buffer in pieces of random sizes
    (chunks split and joined), in a random order with pauses, and the last piece only at end."""
    buffer = np.full_like(flat, np.nan)
    client.begin(buffer)
    cuts = np.sort(rng.choice(np.arange(1, flat.size), 7, replace=False))
    pieces = list(zip([0, *cuts], [*cuts, flat.size], strict=True))
    rng.shuffle(pieces)
    for start, stop in pieces[:-1]:
        time.sleep(0.02)
        buffer[start:stop] = flat[start:stop]
        client.filled(start, stop)
    start, stop = pieces[-1]
    buffer[start:stop] = flat[start:stop]
    return client.end()


class NumpyExchange(PSExchange):
    """The ``ps`` exchange over NumPy arrays: a framework's conversions, without a framework."""

    def flatten(self, grads):
        return np.concatenate([g.reshape(-1) for g in grads]).astype(np.float32)

    def unflatten(self, flat):
        return [part.copy() for part in self.split(flat)]

    def any_rank(self, flag):
        return flag


def grads(step: int, rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng([step, rank])
    return [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]


def compressing_worker(world, cfg, out: Path, steps: int, save_at: int, resume: str) -> dict:
    workers = len(world.worker_ranks)
    exchange = NumpyExchange(make_client(cfg.ps, cfg.comm, SHAPES, seed=5), world.rank, workers,
                             SHAPES)
    if resume and world.rank == 0:
        with np.load(resume) as saved:
            exchange.load_state_dict(dict(saved), resume)
    exchange.broadcast()
    first, pulled, mean = exchange.client.step, 0.0, None
    for step in range(first, steps):
        mean = exchange.run(grads(step, world.rank))
        pulled = pulled + exchange.flatten(mean).astype(np.float64) * workers
        if step + 1 == save_at:
            exchange.gather()
            if world.rank == 0:
                np.savez(out / "state.npz", **exchange.state_dict())
    exchange.gather()
    exchange.finish()
    record = {"role": "worker", "first": first, "pushed": exchange.client.pushed_bytes,
              "pulled": exchange.client.pulled_bytes, "stats": exchange.stats}
    if world.rank == 0:
        np.save(out / "last.npy", exchange.flatten(mean))
    if world.rank == 0 and first == 0:  # a resumed run owed residuals from before it started
        entry, owed = exchange.state_dict(), 0.0
        if exchange.client.settings.feedback:  # every worker's push residuals and the servers'
            rows = np.concatenate([entry[f"residual/{i}"].reshape(workers, -1)
                                   for i in range(len(SHAPES))], axis=1)
            owed = rows.astype(np.float64).sum(axis=0) + entry.get("ps_server_residual", 0.0)
        pushed = sum(exchange.flatten(grads(s, r)).astype(np.float64)
                     for s in range(first, steps) for r in range(workers))
        record["lost"] = float(np.abs(pulled + owed - pushed).max())
    return record


PARAMS = {"topk": ["comm.ratio=0.05", "comm.min_size=256"],
          "randomk": ["comm.ratio=0.05", "comm.min_size=256"],
          "qsgd": ["comm.min_size=256", "comm.bucket=128"]}
"""Each method's parameters (a key the method does not read is refused)."""


def main() -> None:
    mode, out, servers = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    compression = sys.argv[4] if len(sys.argv) > 4 else "none"
    cfg = load_config(None, ["comm.topology=ps", f"ps.servers={servers}", "ps.chunk_kib=1",
                             f"comm.compression={compression}", *PARAMS.get(compression, []),
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
            record = (worker(world, cfg, out) if mode != "compress" else
                      compressing_worker(world, cfg, out, int(sys.argv[5]), int(sys.argv[6]),
                                         sys.argv[7] if len(sys.argv) > 7 else ""))
        except HvdtrainError as exc:  # as the driver and the CLI handle it
            end_job_at_exit(world, exc)
            print(f"hvdtrain: error: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
    record["modules"] = sorted(m for m in FRAMEWORKS if m in sys.modules)
    (out / f"rank{world.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
