"""One training job on the ResNet-18 workload: hvdtrain or hand-written Horovod (horovodrun), or
PyTorch DDP (torchrun).

Every trainer trains the same thing: hvdtrain's ``resnet18`` (11.2 M parameters at width 64) on its
``synthetic_images`` (3x32x32, 10 classes), SGD at ``0.05 x ranks`` with momentum 0.9, a batch of
``--batch`` per rank from one permutation of the training set sharded by rank, for ``--steps``
optimizer steps. Throughput is taken over the steps after the first ``--skip`` (which touch cold
memory and, for DDP, build its buckets): from the start of step ``skip`` to the start of the last
step, on rank 0, ``samples_per_s`` = global samples in those steps / seconds. Rank 0 prints one
JSON line with it and, for the hand-written loops, ``phases_ms``: the median of each part of a step
over the same steps (:data:`PHASES`).

::

    horovodrun -np 2 --gloo python benchmarks/resnet_worker.py --trainer hvdtrain
    horovodrun -np 2 --gloo python benchmarks/resnet_worker.py --trainer horovod
    torchrun --standalone --nproc-per-node 2 benchmarks/resnet_worker.py --trainer ddp

The DDP side is what a PyTorch user writes: ``init_process_group("gloo")``,
``DistributedDataParallel`` with its defaults (25 MB buckets, buffers broadcast every forward),
mean cross-entropy, ``torch.optim.SGD``. Both sides use ``workload.threads_per_rank`` compute
threads unless ``--threads`` is given, and neither evaluates or saves inside the timed span.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness
import workload

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's hvdtrain, even where none is installed

SIZES = {"rounds": (3, 1), "warmup": (0, 0), "steps": (20, 6), "width": (64, 8)}
"""The drivers' sizes (``ddp.py``, ``scaling.py``): full and ``--quick``."""


def driver_options(p: argparse.ArgumentParser) -> None:
    """The options the drivers of this worker add to ``harness.parser(..., SIZES)``."""
    p.add_argument("--skip", type=int, default=3, help="first steps not timed (default 3)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank (default 32)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment of the horovodrun jobs, e.g. HOROVOD_CYCLE_TIME=5")


def job_argv(launcher: Sequence[str], args: argparse.Namespace, trainer: str,
             threads: int = 0) -> list[str]:
    """``launcher`` followed by one run of this worker with the driver's options."""
    return [*launcher, str(Path(__file__).resolve()), "--trainer", trainer, "--steps",
            str(args.steps), "--skip", str(args.skip), "--batch", str(args.batch), "--width",
            str(args.width), "--threads", str(threads)]


def horovodrun(np: int, controller: str = "gloo") -> list[str]:
    """The launcher of a ``horovodrun`` job of ``np`` ranks running this interpreter."""
    return [harness.horovodrun(), "-np", str(np), f"--{controller}", str(harness.python())]


def driver_note(args: argparse.Namespace) -> str:
    """What every job of this worker trained and how its throughput is taken."""
    params = ", 11.2 M parameters" if args.width == 64 else ""
    return (f"Workload: hvdtrain's `resnet18` (width {args.width}{params}) on "
            f"`synthetic_images` 3x32x32, 10 classes; batch {args.batch} per rank; SGD lr "
            f"{workload.BASE_LR} x ranks, momentum {workload.MOMENTUM}; {args.steps} steps a "
            f"job, samples/s over steps {args.skip + 1} to {args.steps - 1} on rank 0; "
            f"{args.rounds} rounds after {args.warmup} warm-up, one job per variant per round; "
            f"environment of the horovodrun jobs: {' '.join(args.env) or 'Horovod defaults'}.")


def dataset(args: argparse.Namespace, ranks: int) -> Any:
    """Enough training samples for every step at this world size, and a token test split."""
    from hvdtrain.data.synthetic import SyntheticImages

    return SyntheticImages(train_samples=args.steps * args.batch * ranks, test_samples=ranks,
                           seed=workload.SEED)


def span(clock: workload.Clock, skip: int, global_batch: int) -> float:
    """Samples per second from the start of step ``skip`` to the start of the last step."""
    starts = clock.step_starts
    if len(starts) - 1 <= skip:
        raise SystemExit(f"--steps must exceed --skip + 1 (got {len(starts)} steps, skip {skip})")
    return (len(starts) - 1 - skip) * global_batch / (starts[-1] - starts[skip])


PHASES = ("forward", "backward", "wait", "update")
"""The parts of a hand-written step, timed apart on every rank: forward pass and loss, backward
pass (DDP's includes its wait for the last buckets), Horovod's wait for the allreduce
(``optimizer.synchronize()``; zero for DDP), optimizer update."""


def phases_ms(marks: Sequence[Sequence[float]]) -> dict[str, float]:
    """Each phase's median milliseconds over the steps whose clock readings are ``marks`` (one
    reading before the step and one after each of :data:`PHASES`)."""
    import numpy as np

    spans = np.diff(np.asarray(marks, dtype=float), axis=1) * 1000.0
    return dict(zip(PHASES, (round(float(v), 2) for v in np.median(spans, axis=0)), strict=True))


def run_hvdtrain(args: argparse.Namespace) -> dict[str, Any]:
    """Trains with hvdtrain's own loop (``train(cfg)``), configured to match :func:`run_plain`."""
    import torch

    from hvdtrain.config import load_config
    from hvdtrain_worker import train_clocked

    # hvdtrain starts Horovod itself, after choosing its cycle time from the model: starting it
    # here would fix Horovod's default instead. The launcher's environment gives the world size.
    size = int(os.environ.get("HOROVOD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
    out = tempfile.mkdtemp(prefix="hvdtrain-resnet-")
    cfg = load_config(ROOT / "configs" / "digits_torch.yaml", [
        "model.name=resnet18", f"model.options={{width: {args.width}}}",
        "data.name=synthetic_images",
        f"data.options={{train_samples: {args.steps * args.batch * size}, "
        f"test_samples: {size}, seed: {workload.SEED}}}",
        f"data.batch_size={args.batch}", f"train.max_steps={args.steps}", "train.epochs=1",
        f"train.threads={args.threads}", "optim.name=sgd", f"optim.lr={workload.BASE_LR}",
        f"optim.momentum={workload.MOMENTUM}", "optim.warmup_steps=0", "optim.schedule=constant",
        "optim.scale_lr=true", "comm.compression=none", "checkpoint.enabled=false",
        "checkpoint.every_steps=0",
        "log.console=false", "log.wandb=disabled", "log.tensorboard=false",
        f"log.dir={out}", f"seed={workload.SEED}"], environ={})
    result, clock = train_clocked(cfg)
    engine = result.engine
    return {"rank": engine.rank, "ranks": engine.size, "threads": torch.get_num_threads(),
            "samples_per_s": span(clock, args.skip, args.batch * engine.size),
            "train_loss": result.summary["final"].get("train_loss"),
            "horovod_cycle_time_ms": result.summary["horovod_cycle_time_ms"]}


def run_plain(args: argparse.Namespace) -> dict[str, Any]:
    """A hand-written loop, as a user of the library writes it: ``DistributedDataParallel``
    under ``torchrun`` (``--trainer ddp``) or ``hvd.DistributedOptimizer`` under ``horovodrun``
    (``--trainer horovod``); same model, data and optimizer as :func:`run_hvdtrain`. With
    ``--trainer alone`` (under ``horovodrun``, for its rank variables) every process runs the same
    loop on its shard without communicating, and rank 0's samples/s is scaled by the process count:
    what the host's cores deliver to that many processes before any gradient exchange."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from hvdtrain.torch.models import resnet18_module

    if args.trainer == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    elif args.trainer == "horovod":
        import horovod.torch as hvd
        hvd.init()
        rank, size, local = hvd.rank(), hvd.size(), hvd.local_size()
    else:  # "alone": the same steps on this rank's shard, no communication: the host's ceiling
        rank, size = int(os.environ.get("HOROVOD_RANK", 0)), int(os.environ.get("HOROVOD_SIZE", 1))
        local = int(os.environ.get("HOROVOD_LOCAL_SIZE", size))
    torch.set_num_threads(args.threads or workload.threads_per_rank(local))
    torch.manual_seed(workload.SEED + rank)
    data = dataset(args, size).train()
    model = resnet18_module(3, 10, args.width)
    if args.trainer == "ddp":
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=workload.BASE_LR * size,
                                momentum=workload.MOMENTUM)
    if args.trainer == "horovod":
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    order = np.random.default_rng([workload.SEED, 0]).permutation(len(data))
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    clock, marks = workload.Clock(), []
    for step in range(args.steps):
        clock.step()
        idx = torch.from_numpy(order[step * args.batch * size:(step + 1) * args.batch * size]
                               [rank::size])
        marks.append([time.perf_counter()])
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        marks[-1].append(time.perf_counter())
        loss.backward()
        marks[-1].append(time.perf_counter())
        if args.trainer == "horovod":  # what `step()` does, with the wait for the allreduce apart
            optimizer.synchronize()
            marks[-1].append(time.perf_counter())
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            marks[-1].append(marks[-1][-1])
            optimizer.step()
        marks[-1].append(time.perf_counter())
    result = {"rank": rank, "ranks": size, "threads": torch.get_num_threads(),
              "samples_per_s": span(clock, args.skip, args.batch * size),
              "phases_ms": phases_ms(marks[args.skip:]), "train_loss": float(loss.detach())}
    if args.trainer == "ddp":
        # Both ranks done with every collective before either tears Gloo down: a peer that closes
        # its pairs while the other still reads them aborts that one (SIGABRT in Gloo's pair).
        dist.barrier()
        dist.destroy_process_group()
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Trainer, steps, skipped steps, batch per rank, model width, threads per rank."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=("hvdtrain", "ddp", "horovod", "alone"), required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=3, help="first steps left out of the figure")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--width", type=int, default=64, help="resnet18 width (64: ResNet-18)")
    parser.add_argument("--threads", type=int, default=0,
                        help="compute threads per rank (0: cores / ranks on the host)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the chosen trainer once and prints rank 0's measurement."""
    args = parse_args(argv)
    record = run_hvdtrain(args) if args.trainer == "hvdtrain" else run_plain(args)
    workload.report({**record, "trainer": args.trainer, "steps": args.steps, "skip": args.skip,
                     "batch": args.batch, "width": args.width})
    return 0


if __name__ == "__main__":
    sys.exit(main())
