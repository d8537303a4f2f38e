"""The anchor of the compression convergence study: PyTorch DDP with torch's own PowerSGD hook,
under ``torchrun``, on hvdtrain's model, data, sampler and learning-rate schedule.

One run trains the MNIST-1D paper's 1-D CNN (:func:`compression.cnn1d`) on hvdtrain's
``Mnist1dDataset`` with SGD momentum, exactly as ``configs/digits_torch.yaml`` with
``compression.DATASETS["mnist1d-cnn"]``'s overrides trains it: the model built after
``torch.manual_seed(seed + rank)`` (DDP then broadcasts rank 0's weights, as hvdtrain does), each
epoch's batches from :class:`hvdtrain.data.sampler.ShardedSampler` (``seed``), the rate of
:func:`hvdtrain.schedule.lr_at` at every step. Without ``--hook`` it is plain DDP (the check that
the anchor trains what hvdtrain's ``none`` trains); with ``--hook powersgd`` it registers
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook`` (rank
``--rank``, error feedback, warm start, ``start_powerSGD_iter=--start``, torch's defaults
otherwise). Rank 0 prints one JSON line: the final eval accuracy, the accuracy after every epoch
and the steps.

::

    torchrun --standalone --nproc-per-node 2 benchmarks/compression_hook.py --seed 0 \\
        --hook powersgd --start-iter 240
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's hvdtrain
sys.path.insert(0, str(ROOT / "benchmarks"))

KEY = "bench_compression_hook"


def overrides(seed: int) -> list[str]:
    """The config the hvdtrain runs of the study train (the digits config, MNIST-1D CNN, SGD)."""
    from compression import DATASETS, OPTIMIZERS

    return [f"seed={seed}", *DATASETS["mnist1d-cnn"], *OPTIMIZERS["sgd"]]


def evaluate(model: Any, x: Any, y: Any) -> float:
    """Accuracy over the whole test split (every rank scores all of it: no collective)."""
    import torch

    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 512]).argmax(1) == y[i:i + 512]).sum())
                      for i in range(0, len(y), 512))
    model.train()
    return correct / len(y)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Trains one run; returns rank 0's record (every rank returns one)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel

    from compression import cnn1d
    from hvdtrain.config import load_config
    from hvdtrain.data.mnist1d import Mnist1dDataset
    from hvdtrain.data.sampler import ShardedSampler
    from hvdtrain.schedule import lr_at

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    epochs = [f"train.epochs={args.epochs}"] if args.epochs else []
    cfg = load_config(ROOT / "configs" / "digits_torch.yaml", [*overrides(args.seed), *epochs],
                      environ={})
    data = Mnist1dDataset()
    train, test = data.train(), data.test()
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
    tx, ty = torch.from_numpy(test.x), torch.from_numpy(test.y)
    torch.manual_seed(cfg.seed + rank)
    model = DistributedDataParallel(cnn1d(data.spec()))
    if args.hook == "powersgd":
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank,
                                   start_powerSGD_iter=args.start_iter, use_error_feedback=True,
                                   warm_start=True, random_seed=cfg.seed)
        model.register_comm_hook(state, psgd.powerSGD_hook)
    o = cfg.optim
    opt = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum,
                          weight_decay=o.weight_decay)
    sampler = ShardedSampler(len(y), cfg.data.batch_size, seed=cfg.seed)
    total = cfg.train.epochs * sampler.steps_in_epoch(size)
    step, curve = 0, []
    for epoch in range(cfg.train.epochs):
        for plan in sampler.steps(epoch, rank, size):
            idx = torch.from_numpy(plan.micro[0])
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, o, size)
            opt.zero_grad()
            # hvdtrain's weighting: each rank's share of the step's global batch, so that DDP's
            # average over the ranks is the mean over the global batch when shards differ.
            loss = F.cross_entropy(model(x[idx]), y[idx], reduction="sum") * size
            (loss / plan.global_count).backward()
            opt.step()
            step += 1
        curve.append(evaluate(model.module, tx, ty))
    dist.destroy_process_group()
    return {KEY: 1, "hook": args.hook, "start": args.start_iter if args.hook else 0,
            "seed": args.seed, "accuracy": curve[-1], "curve": curve, "steps": step}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hook", choices=("", "powersgd"), default="")
    p.add_argument("--rank", type=int, default=2, help="PowerSGD's rank (hvdtrain's default)")
    p.add_argument("--start-iter", type=int, default=2,
                   help="start_powerSGD_iter: dense steps first (torch's minimum: 2)")
    p.add_argument("--epochs", type=int, default=0, help="train.epochs (0: the study's 60)")
    args = p.parse_args(argv)
    record = run(args)
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
