"""The baseline of the PyTorch overhead benchmark: a Horovod PyTorch loop written by hand.

It is what a user writes after Horovod's ``examples/pytorch/pytorch_mnist.py``, trained on the same
problem as ``configs/digits_torch.yaml``: scikit-learn's digits (same stratified split as
``hvdtrain.data.digits.DigitsDataset``), the same MLP, SGD at ``0.05 x size`` with momentum 0.9,
``hvd.DistributedOptimizer``, a per-rank batch of 32 sharded by ``DistributedSampler`` with a
shuffle per epoch, then one evaluation on the test split and one ``torch.save`` on rank 0.
The loop is the one Horovod's users write (and issue 58's): ``train_loader.sampler.set_epoch(epoch)``
and ``for x, y in train_loader`` over a ``DataLoader`` with a ``DistributedSampler``. The data stay
in memory: the dataset (:class:`Indexed`) hands the loader a batch by one tensor indexing
(``__getitems__``, identity collation), so a per-sample collation does not enter the comparison;
the API loop (``api_worker.py``) goes through a ``DataLoader`` over the same dataset the same way.
It deliberately does not import hvdtrain; its settings and data come from :mod:`workload`, as the
other workers' do.

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
from torch.utils.data import DataLoader
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


class Indexed(torch.utils.data.Dataset):
    """Two tensors, fetched a batch at a time by indexing (``DataLoader`` calls ``__getitems__``)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(idx, dtype=torch.long)
        return self.x[index], self.y[index]


def keep_batch(batch: Any) -> Any:
    """The loaders' ``collate_fn``: ``Indexed.__getitems__`` already returns the batch."""
    return batch


def make_loader(x: torch.Tensor, y: torch.Tensor) -> DataLoader:
    """The training loader as in Horovod's ``pytorch_mnist.py``: a ``DistributedSampler`` that
    shuffles per epoch, ``BATCH_SIZE`` samples per rank and step, no loader workers."""
    dataset = Indexed(x, y)
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True,
                                 seed=SEED)
    return DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, num_workers=0,
                      collate_fn=keep_batch)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, train_loader: DataLoader,
          epochs: int, clock: workload.Clock) -> int:
    """Trains for ``epochs`` epochs and returns the number of optimizer steps."""
    model.train()
    steps = 0
    for epoch in range(epochs):
        train_loader.sampler.set_epoch(epoch)  # type: ignore[union-attr]
        for x, y in train_loader:
            clock.step()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
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

    Every call builds its own model, optimizer and loader and reseeds, so repeated calls in one
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
    train_loader = make_loader(train_x, train_y)

    clock = workload.Clock()
    started = time.perf_counter()
    steps = train(model, optimizer, train_loader, epochs, clock)
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
