"""Compressed accuracy without Horovod: two ranks simulated as threads of one process, the core's
compressing exchange (plans and update rules) run on the NumPy reference kernels, and the MNIST-1D
1-D CNN of :func:`compression.cnn1d` trained by torch. For studying the update rules (DGC,
compressed Adam) where ``horovodrun`` is not available; ``compression.py`` is the benchmark of
record. Differences from a real run: the NumPy hub stands for Horovod's ring (the same means up to
rounding), and the batches come from a permutation of its own (not hvdtrain's sampler); the
learning rate follows the digits config (20 warm-up steps, cosine, scaled by the 2 ranks).

Usage (one run a process, one JSON line printed; then the table over a file of such lines)::

    .venv/bin/python benchmarks/compression_sim.py run topk sgd --seed 0 --epochs 10 \\
        --extra '{"sparsity_warmup_steps": 250}' >> results.jsonl
    .venv/bin/python benchmarks/compression_sim.py table results.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

SIZE, BATCH = 2, 32
LR = {"sgd": 0.05, "adam": 0.002}


def train_rank(r: int, hub: Any, args: argparse.Namespace, data: Any, out: list) -> None:
    """One simulated rank's training; its test accuracy into ``out[r]``."""
    import torch

    from compression import cnn1d  # type: ignore[import-not-found]
    from hvdtrain.compression import make_plan
    from hvdtrain.compression.rules import OptimizerSettings
    from hvdtrain.config import CommConfig
    from tests.unit.numpy_world import NumpyExchange

    torch.manual_seed(args.seed)  # the same initial weights on both ranks
    model = cnn1d(data.spec())
    params = list(model.parameters())
    extra = json.loads(args.extra)
    comm = CommConfig(compression=args.method, **{"ratio": 0.01, "min_size": 0, **extra})
    opt = OptimizerSettings(args.optimizer, momentum=0.9 if args.optimizer == "sgd" else 0.0)
    exchange = NumpyExchange(make_plan(comm, args.seed, [p.shape for p in params]), r, SIZE, hub,
                             opt, lambda: [p.detach().numpy() for p in params])
    lr = LR[args.optimizer] * SIZE
    optimizer: torch.optim.Optimizer
    if exchange.rule.updates:
        optimizer = torch.optim.SGD(params, lr=lr)
    elif args.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(params, lr=lr)
    train, test = data.train(), data.test()
    per_epoch = len(train.x) // (BATCH * SIZE)
    total, step = per_epoch * args.epochs, 0
    order_rng = np.random.default_rng(args.seed)
    for _ in range(args.epochs):
        order = order_rng.permutation(len(train.x))
        for s in range(per_epoch):
            step += 1
            for group in optimizer.param_groups:
                group["lr"] = lr * min(1.0, step / 20) * 0.5 * (1 + math.cos(math.pi * step / total))
            idx = order[(s * SIZE + r) * BATCH:(s * SIZE + r + 1) * BATCH]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(train.x[idx])),
                                                     torch.from_numpy(train.y[idx]))
            loss.backward()
            grads = [p.grad.numpy().copy() for p in params]
            if args.method == "none":
                posts = hub.all(r, grads)
                averaged = [np.mean([p[i] for p in posts], axis=0) for i in range(len(grads))]
            else:
                averaged = exchange.run(grads)
            for p, g in zip(params, averaged, strict=True):
                p.grad = torch.from_numpy(np.ascontiguousarray(g, dtype=np.float32))
            optimizer.step()
    with torch.no_grad():
        predicted = model(torch.from_numpy(test.x)).argmax(1).numpy()
    out[r] = float((predicted == test.y).mean())


def run(args: argparse.Namespace) -> None:
    """Trains both ranks and prints the run's JSON line."""
    import torch

    from hvdtrain.data.mnist1d import Mnist1dDataset
    from tests.unit.numpy_world import Hub

    torch.set_num_threads(1)
    data, hub, out = Mnist1dDataset(), Hub(SIZE), [0.0] * SIZE
    threads = [threading.Thread(target=train_rank, args=(r, hub, args, data, out))
               for r in range(SIZE)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"method": args.method, "opt": args.optimizer, "seed": args.seed,
                      "epochs": args.epochs, "extra": json.loads(args.extra), "acc": out[0]}),
          flush=True)


def table(path: Path) -> str:
    """Per optimizer and variant, the mean loss against ``none`` (paired by seed) and its 95%
    interval, in Markdown."""
    from compression import paired_loss  # type: ignore[import-not-found]

    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in records:
        r["accuracy"] = r["acc"]
        r["variant"] = r["method"] + (" " + json.dumps(r["extra"], sort_keys=True)
                                      if r["extra"] else "")
    rows = ["| optimizer | variant | seeds | none mean | variant mean | loss (points) | 95% interval |",
            "|---|---|---|---|---|---|---|"]
    for opt in dict.fromkeys(r["opt"] for r in records):
        base = [r for r in records if r["opt"] == opt and r["method"] == "none"]
        for variant in dict.fromkeys(r["variant"] for r in records if r["opt"] == opt):
            rs = [r for r in records if r["opt"] == opt and r["variant"] == variant]
            if not base or rs[0]["method"] == "none":
                continue
            mean, half, n = paired_loss(rs, base)
            seeds = {r["seed"] for r in rs}
            none_mean = np.mean([b["accuracy"] for b in base if b["seed"] in seeds])
            interval = "—" if half != half else f"{100 * (mean - half):+.1f} to {100 * (mean + half):+.1f}"
            rows.append(f"| {opt} | `{variant}` | {n} | {none_mean:.3f} | "
                        f"{np.mean([r['accuracy'] for r in rs]):.3f} | {100 * mean:+.1f} | {interval} |")
    return "\n".join(rows)


def main() -> int:
    """``run`` one configuration or print the ``table`` of a results file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("method")
    r.add_argument("optimizer", choices=sorted(LR))
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--epochs", type=int, default=10)
    r.add_argument("--extra", default="{}", help="comm.* settings as JSON")
    t = sub.add_parser("table")
    t.add_argument("path", type=Path)
    args = p.parse_args()
    if args.command == "run":
        run(args)
    else:
        print(table(args.path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
