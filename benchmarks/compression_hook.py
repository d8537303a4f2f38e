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

``--dataset images`` trains ResNet-18 on ``configs/images_torch.yaml``; ``--dataset lm`` the
built-in GPT on ``configs/lm_torch.yaml`` (Adam as configured, ``--width`` its ``d_model``) over
the text corpus at ``--corpus``, and its figure is eval perplexity (``perplexity``, ``curve``):
the exponential of the mean token cross-entropy over the evaluation windows, as hvdtrain's loop
computes ``eval_perplexity``. The optimizer is hvdtrain's own
(:func:`hvdtrain.torch.engine.make_optimizer`).

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


def overrides(seed: int, dataset: str = "mnist1d-cnn") -> list[str]:
    """The config the hvdtrain runs of the study train: the MNIST-1D CNN on the digits config, or
    ResNet-18 on ``configs/images_torch.yaml`` (both SGD momentum), or the GPT on
    ``configs/lm_torch.yaml`` (its own Adam)."""
    from compression import DATASETS, IMAGE_OPTIMIZERS, LM_OPTIMIZERS, OPTIMIZERS

    if dataset == "lm":
        return [f"seed={seed}", *LM_OPTIMIZERS["adam"]]
    if dataset == "images":
        return [f"seed={seed}", *IMAGE_OPTIMIZERS["sgd"]]
    return [f"seed={seed}", *DATASETS[dataset], *OPTIMIZERS["sgd"]]


def evaluate(model: Any, source: Any, rank: int, size: int, batch: int,
             adapter: Any = None) -> float:
    """Accuracy over the test split as hvdtrain's loop scores it: each rank its own shard
    (:func:`hvdtrain.data.sampler.eval_shards`) on its own model (batch-norm statistics are a
    rank's own in hvdtrain), the correct counts summed over the ranks. With ``adapter`` (the
    GPT's): the perplexity, ``exp`` of the adapter's loss sums over the windows' count."""
    import math

    import torch
    import torch.distributed as dist

    from hvdtrain.data.sampler import eval_shards

    model.eval()
    counts = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for idx in eval_shards(len(source), rank, size, batch):
            if len(idx):
                b = source.load(idx)
                x, y = torch.from_numpy(b.x), torch.from_numpy(b.y)
                if adapter is not None:
                    loss, _ = adapter.loss_and_metrics(model, x, y, training=False)
                    good = float(loss)
                else:
                    good = float((model(x).argmax(1) == y).sum())
                counts += torch.tensor([good, float(len(idx))], dtype=torch.float64)
    model.train()
    dist.all_reduce(counts)
    mean = float(counts[0] / counts[1])
    return math.exp(mean) if adapter is not None else mean


def config(args: argparse.Namespace) -> Any:
    """hvdtrain's resolved config of the run (its model, data, batch, schedule and budget)."""
    from hvdtrain.config import load_config

    extra = [f"train.epochs={args.epochs}"] if args.epochs else []
    if args.dataset == "images":
        extra += [f"data.options.root={args.images}", f"train.max_steps={args.max_steps}"]
    elif args.dataset == "lm":
        extra += [f"data.options.root={args.corpus}", f"train.max_steps={args.max_steps}",
                  f"model.options.d_model={args.width}"]
    elif args.max_steps:
        extra.append(f"train.max_steps={args.max_steps}")
    name = {"images": "images_torch", "lm": "lm_torch"}.get(args.dataset, "digits_torch")
    return load_config(ROOT / "configs" / f"{name}.yaml",
                       [*overrides(args.seed, args.dataset), *extra], environ={})


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Trains one run; returns rank 0's record (every rank returns one)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel

    from hvdtrain.adapters import make_adapter
    from hvdtrain.data.contracts import Draw
    from hvdtrain.data.sampler import ShardedSampler
    from hvdtrain.driver import make_dataset
    from hvdtrain.registry import MODELS
    from hvdtrain.schedule import lr_at
    from hvdtrain.torch.engine import make_optimizer
    from hvdtrain.torch.models import ClassifierAdapter

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = config(args)
    data = make_dataset(cfg)
    train, test = data.train(), data.test()
    adapter = make_adapter(MODELS["torch"].get(cfg.model.name), cfg.model.options,
                           cfg.model.name, ClassifierAdapter)
    torch.manual_seed(cfg.seed + rank)
    # broadcast_buffers=False: hvdtrain keeps each rank's batch-norm statistics its own. One
    # bucket (a cap above any model here; a set cap also sizes the first): with two, the hook's
    # chained Gloo allreduces of the buckets ran in another order on each rank (ResNet-18:
    # "Received data size doesn't match expected size").
    model = DistributedDataParallel(adapter.build(data.spec()), broadcast_buffers=False,
                                    bucket_cap_mb=1024)
    if args.hook == "powersgd":
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank,
                                   start_powerSGD_iter=args.start_iter, use_error_feedback=True,
                                   warm_start=True, random_seed=cfg.seed)
        model.register_comm_hook(state, psgd.powerSGD_hook)
    o = cfg.optim
    opt = make_optimizer(o, model)
    lm = adapter if args.dataset == "lm" else None
    sampler = ShardedSampler(len(train), cfg.data.batch_size, seed=cfg.seed,
                             shuffle=cfg.data.shuffle)
    total = cfg.train.epochs * sampler.steps_in_epoch(size)
    total = min(total, cfg.train.max_steps) if cfg.train.max_steps else total
    step, curve = 0, []
    for epoch in range(cfg.train.epochs):
        for plan in sampler.steps(epoch, rank, size):
            if step == total:
                break
            batch = train.load(plan.micro[0], Draw(cfg.seed, epoch))
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, o, size)
            opt.zero_grad()
            # hvdtrain's weighting: each rank's share of the step's global batch, so that DDP's
            # average over the ranks is the mean over the global batch when shards differ.
            loss, _ = adapter.loss_and_metrics(model, torch.from_numpy(batch.x),
                                               torch.from_numpy(batch.y))
            (loss * size / plan.global_count).backward()
            opt.step()
            step += 1
        curve.append([step, evaluate(model.module, test, rank, size, cfg.data.eval_batch_size,
                                     lm)])
        if step == total:
            break
    dist.destroy_process_group()
    metric = "perplexity" if lm is not None else "accuracy"
    return {KEY: 1, "hook": args.hook, "start": args.start_iter if args.hook else 0,
            "seed": args.seed, metric: curve[-1][1], "curve": curve, "steps": step}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hook", choices=("", "powersgd"), default="")
    p.add_argument("--rank", type=int, default=2, help="PowerSGD's rank (hvdtrain's default)")
    p.add_argument("--start-iter", type=int, default=2,
                   help="start_powerSGD_iter: dense steps first (torch's minimum: 2)")
    p.add_argument("--epochs", type=int, default=0, help="train.epochs (0: the config's)")
    p.add_argument("--dataset", choices=("mnist1d-cnn", "images", "lm"), default="mnist1d-cnn",
                   help="images: ResNet-18 on configs/images_torch.yaml; lm: the GPT on "
                        "configs/lm_torch.yaml")
    p.add_argument("--corpus", default="", help="the text corpus's root (--dataset lm)")
    p.add_argument("--width", type=int, default=64, help="the GPT's d_model (--dataset lm)")
    p.add_argument("--images", default="", help="the generated images' root (--dataset images)")
    p.add_argument("--max-steps", type=int, default=0, help="train.max_steps (0: none)")
    args = p.parse_args(argv)
    record = run(args)
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
