"""The GPU check's measurements (run by scripts/gpu_check.sh): hvdtrain's built-in ResNet-18 on
synthetic images at one rank, in fp32, bf16 and fp16, against a plain PyTorch loop on the same
model, data, batch and optimizer; prints one Markdown row per precision and trainer.

Throughput is taken over the steps after the first ``--skip`` (cuDNN's autotuning and cold
memory), from the start of step ``skip`` to the end of the last, the GPU synchronized at both ends.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hvdtrain.config import load_config
from hvdtrain.driver import make_dataset, train
from hvdtrain.loop import Callback
from hvdtrain.torch.models import resnet18_module

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class StepClock(Callback):
    """Start times of each step and the end of the run, the GPU synchronized first."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_step_start(self, step: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())


def rate(starts: list[float], end: float, skip: int, batch: int) -> float:
    """Samples per second from the start of step ``skip`` to ``end``."""
    return (len(starts) - skip) * batch / (end - starts[skip])


def run_hvdtrain(args: argparse.Namespace, precision: str) -> dict[str, Any]:
    cfg = load_config(None, [
        "model.name=resnet18", f"model.options.width={args.width}", "data.name=synthetic_images",
        f"data.batch_size={args.batch}", f"train.max_steps={args.steps}", "train.epochs=1000",
        f"train.device={args.device}", f"train.precision={precision}", "optim.warmup_steps=0",
        "checkpoint.enabled=false", "checkpoint.every_steps=0",
        "log.console=false", "log.tensorboard=false",
        "log.wandb=disabled",
        "log.system=false", f"log.dir={args.out}/hvdtrain-{precision}", "log.overwrite=true",
        f"log.every_steps={args.steps}", "train.eval_every_epochs=1000"], environ={})
    clock = StepClock()
    result = train(cfg, [clock])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    end = time.perf_counter()
    return {"samples_per_s": rate(clock.starts, end, args.skip, args.batch),
            "loss": result.summary["final"].get("train_loss", float("nan")),
            "device": result.summary["device"], "collectives": result.summary["collectives"]}


def run_plain(args: argparse.Namespace, precision: str) -> dict[str, Any]:
    """What a PyTorch user writes: the model on the GPU, autocast, GradScaler for fp16."""
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    torch.manual_seed(0)
    split = make_dataset(load_config(None, ["data.name=synthetic_images"], environ={})).train()
    x_all, y_all = torch.from_numpy(split.x).pin_memory() if device.type == "cuda" else \
        torch.from_numpy(split.x), torch.from_numpy(split.y)
    model = resnet18_module(3, 10, args.width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dtype = DTYPES[precision]
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    order = np.random.default_rng(0).permutation(len(x_all))
    starts, loss = [], torch.tensor(0.0)
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        starts.append(time.perf_counter())
        idx = torch.from_numpy(order[(step * args.batch) % (len(order) - args.batch):][:args.batch])
        x, y = x_all[idx].to(device, non_blocking=True), y_all[idx].to(device, non_blocking=True)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"samples_per_s": rate(starts, time.perf_counter(), args.skip, args.batch),
            "loss": float(loss.detach()), "device": str(device), "collectives": "-"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--precisions", default="fp32,bf16,fp16")
    p.add_argument("--out", default="/tmp/hvdtrain-gpu-check")
    args = p.parse_args()
    if not 0 <= args.skip < args.steps:
        p.error(f"--skip {args.skip}: give a number of steps from 0 to --steps - 1 "
                f"({args.steps - 1})")
    print("| precision | trainer | samples/s | ratio to plain | final train loss | device "
          "| collectives |")
    print("|---|---|---|---|---|---|---|")
    for precision in args.precisions.split(","):
        plain = run_plain(args, precision)
        ours = run_hvdtrain(args, precision)
        for name, row in (("plain PyTorch", plain), ("hvdtrain", ours)):
            ratio = row["samples_per_s"] / plain["samples_per_s"]
            print(f"| {precision} | {name} | {row['samples_per_s']:.0f} | {ratio:.3f} "
                  f"| {row['loss']:.4f} | {row['device']} | {row['collectives']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
