"""The baseline of the PyTorch overhead benchmark: a Horovod PyTorch loop written by hand.

It is what a user writes after Horovod's ``examples/pytorch/pytorch_mnist.py``, trained on the same
problem as ``configs/digits_torch.yaml``: scikit-learn's digits (same stratified split as
``hvdtrain.data.digits.DigitsDataset``), the same MLP, SGD at ``0.05 x size`` with momentum 0.9,
``hvd.DistributedOptimizer``, a per-rank batch of 32 sharded by ``DistributedSampler`` with a
shuffle per epoch, then one evaluation on the test split and one ``torch.save`` on rank 0.
The data stay in memory and batches are cut by tensor indexing, as hvdtrain does, so that a
``DataLoader``'s per-sample collation does not enter the comparison. It deliberately does not import
hvdtrain; its settings and data come from :mod:`workload`, as the other workers' do.

The interleaved job (``workload.job_main``) calls :func:`run` as variant
``handwritten_torch:handwritten_torch``. The wall time runs from the first step through the final
evaluation and save (process start, imports, ``hvd.init``, data loading and the initial broadcasts
are excluded, as in hvdtrain's ``summary["wall_time_s"]``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data.distributed import DistributedSampler

import workload
from workload import BASE_LR, BATCH_SIZE, EVAL_BATCH_SIZE, HIDDEN, MOMENTUM, SEED


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and test tensors of the digits, split as ``hvdtrain.data.digits.DigitsDataset``."""
    train_x, train_y, test_x, test_y = workload.load_digits_split()
    return (torch.from_numpy(train_x), torch.from_numpy(train_y), torch.from_numpy(test_x),
            torch.from_numpy(test_y))


def make_model() -> nn.Module:
    """The MLP hvdtrain's ``mlp`` builds with ``hidden: [128]`` for 64 inputs and 10 classes."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, sampler: DistributedSampler,
          x: torch.Tensor, y: torch.Tensor, epochs: int, clock: workload.Clock) -> int:
    """Trains for ``epochs`` epochs and returns the number of optimizer steps."""
    model.train()
    steps = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler))
        for begin in range(0, len(order), BATCH_SIZE):
            clock.step()
            idx = order[begin:begin + BATCH_SIZE]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            steps += 1
    return steps


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Mean test loss and accuracy over all ranks; each rank scores every ``size``-th sample."""
    model.eval()
    mine = torch.arange(hvd.rank(), len(y), hvd.size())
    loss_sum = correct = 0.0
    for begin in range(0, len(mine), EVAL_BATCH_SIZE):
        idx = mine[begin:begin + EVAL_BATCH_SIZE]
        logits = model(x[idx])
        loss_sum += F.cross_entropy(logits, y[idx], reduction="sum").item()
        correct += (logits.argmax(dim=1) == y[idx]).sum().item()
    totals = hvd.allreduce(torch.tensor([loss_sum, correct, float(len(mine))], dtype=torch.float64),
                           op=hvd.Sum, name="eval")
    return totals[0].item() / totals[2].item(), totals[1].item() / totals[2].item()


def run(epochs: int, out_dir: Path) -> dict[str, Any]:
    """Trains from scratch, evaluates, saves to ``out_dir`` on rank 0; returns a measurement.

    Every call builds its own model, optimizer and sampler and reseeds, so repeated calls in one
    process (``workload.job_main``) are independent and alike. ``hvd.init`` is idempotent.
    """
    hvd.init()
    torch.set_num_threads(workload.threads_per_rank(hvd.local_size()))
    torch.manual_seed(SEED + hvd.rank())
    train_x, train_y, test_x, test_y = load_data()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR * hvd.size(), momentum=MOMENTUM)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    sampler = DistributedSampler(torch.utils.data.TensorDataset(train_x, train_y),
                                 num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=SEED)

    clock = workload.Clock()
    started = time.perf_counter()
    steps = train(model, optimizer, sampler, train_x, train_y, epochs, clock)
    clock.evaluation()
    _, eval_accuracy = evaluate(model, test_x, test_y)
    if hvd.rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                   out_dir / "checkpoint.pt")
    wall = time.perf_counter() - started
    return workload.measurement(hvd.rank(), steps, len(train_y) * epochs, wall, eval_accuracy,
                                clock, epochs)


VARIANTS = {"handwritten_torch": run}
"""This worker's run functions by ``harness.Variant`` key."""
