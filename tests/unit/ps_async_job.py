"""An ``ssp``/``asp`` parameter-server job without any framework: real servers (through
``hvdtrain.driver.train``) and NumPy workers that drive the real client on a quadratic.

Usage (under mpirun): ps_async_job.py OUT SERVERS CONSISTENCY STALENESS STEPS OPTIM [RESUME]

Worker w's loss is ``|p - t_w|^2 / 2`` (its gradient ``p - t_w``, so the optimum is the mean of
the targets); worker 1 sleeps 2 ms a push, a straggler. Every worker writes OUT/rank<r>.json with
the staleness each push saw; worker 0 starts the servers' optimizer (from RESUME, an ``.npz`` a
previous job saved, when given), fetches their state once every worker pushed its last and saves
OUT/state.npz.
"""

import json
import sys
import time
from pathlib import Path

import numpy as np

from hvdtrain.config import load_config
from hvdtrain.driver import train
from hvdtrain.ps.exchange import ServerOptimizer, make_client
from hvdtrain.ps.mpi import split

SHAPES = [(1000,), (37, 11)]  # 1,407 elements: 6 chunks of 1 KiB over the servers
LR = 0.1


def targets(rank: int, total: int) -> np.ndarray:
    return (np.arange(total, dtype=np.float32) % 7 + rank).astype(np.float32)


def worker(world, cfg, out: Path, steps: int, optim: str, resume: str | None) -> dict:
    client = make_client(cfg.ps, cfg.comm, SHAPES)
    total = client.layout.total
    # Momentum 0.5 at lr 0.1 barely overshoots (the heavy ball's roots 0.7 +- 0.1i): wherever the
    # pushes of the two workers interleave, the parameters stay between their targets.
    opt = ServerOptimizer(optim, momentum=0.5 if optim == "sgd" else 0.0)
    params = np.zeros(total, np.float32)
    if world.rank == 0:
        start, state = 0, {}
        if resume:
            saved = np.load(resume)
            params, start = saved["params"], int(saved["steps"])
            state = {n: saved[n] for n in opt.names if n in saved}
        client.init(params, opt.hyper(), start, state, opt.names)
    target = targets(world.rank, total)
    seen = []
    for _ in range(steps):
        if world.rank == 1:
            time.sleep(0.002)
        params = client.push_pull(params - target, LR).copy()
        seen.append(client.staleness)
    record = {"role": "worker", "staleness": seen, "versions": client.versions}
    world.workers.Barrier()  # every push applied before worker 0 fetches the state
    if world.rank == 0:
        steps_done, state = client.fetch_state(opt.names)
        np.savez(out / "state.npz", params=client.params, steps=steps_done, **state)
        record["steps"] = steps_done
    client.finish()
    return record


def main() -> None:
    out, servers, consistency = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    staleness, steps, optim = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    resume = sys.argv[7] if len(sys.argv) > 7 else None
    cfg = load_config(None, ["comm.topology=ps", f"ps.servers={servers}", "ps.chunk_kib=1",
                             f"ps.consistency={consistency}", f"ps.staleness={staleness}",
                             "ps.timeout_s=60", f"log.dir={out}"], environ={})
    world = split(servers)
    if world.is_server:
        record = {"role": "server", "served": train(cfg).summary["steps_served"]}
    else:
        record = worker(world, cfg, out, steps, optim, resume)
    record["modules"] = sorted(m for m in ("torch", "tensorflow", "horovod") if m in sys.modules)
    (out / f"rank{world.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
