"""The PyTorch engine: Horovod's DistributedOptimizer driven by the framework-free loop."""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any, Callable, Iterable

import horovod
import horovod.torch as hvd
import numpy as np
import torch

from hvdtrain.adapters import ModelAdapter, make_adapter
from hvdtrain.config import Config
from hvdtrain.data import Dataset, StepIndices
from hvdtrain.engine import Engine, add_batch_sums
from hvdtrain.errors import HvdtrainError
from hvdtrain.registry import MODELS
from hvdtrain.torch.compression import horovod_compression
from hvdtrain.torch.models import ClassifierAdapter


def make_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The configured optimizer; its learning rate is set by the loop before every step."""
    o = cfg.optim
    if o.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum,
                               weight_decay=o.weight_decay)
    cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    return cls(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)


class TorchEngine(Engine):
    """Trains a ``torch.nn.Module`` on Horovod; see :class:`hvdtrain.engine.Engine`."""

    framework = "torch"

    def __init__(self) -> None:
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()

    def prepare(self, cfg: Config, dataset: Dataset) -> None:
        # Ranks sharing a host would otherwise each start one thread per core and fight over them.
        torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // self.local_size))
        torch.manual_seed(cfg.seed + self.rank)
        self.adapter: ModelAdapter = make_adapter(MODELS["torch"].get(cfg.model.name),
                                                  cfg.model.options, cfg.model.name, ClassifierAdapter)
        self.model = self.adapter.build(dataset.spec())
        if not isinstance(self.model, torch.nn.Module):
            raise HvdtrainError(f"model {cfg.model.name!r}: build() must return a torch.nn.Module")
        self.train_x, self.train_y = self._tensors(dataset.train())
        self.test_x, self.test_y = self._tensors(dataset.test())
        optimizer = make_optimizer(cfg, self.model)
        self.optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=self.model.named_parameters(),
            compression=horovod_compression(cfg.comm.compression),
            backward_passes_per_step=cfg.train.backward_passes_per_step)
        self.model.train()  # evaluate() switches to eval mode and back
        self.lr = float("nan")  # the loop sets the real one before the first step

    def broadcast_state(self) -> None:
        # Optimizer state first: on a rank without state Horovod makes it with a zero-gradient step,
        # which weight decay would turn into a change of the weights that the broadcast then undoes.
        hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)

    @staticmethod
    def _tensors(split: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(split.x), torch.from_numpy(split.y)

    def train_step(self, step: StepIndices, lr: float) -> dict[str, float]:
        if lr != self.lr:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.lr = lr
        self.optimizer.zero_grad()
        # Horovod averages over ranks; weighting each rank's summed loss by size / global_count makes
        # the result the mean over the step's samples, even when ranks hold unequal shares.
        scale = self.size / step.global_count
        sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
        for idx in step.micro:
            index = torch.from_numpy(idx)
            loss_sum, metrics = self.adapter.loss_and_metrics(
                self.model, self.train_x[index], self.train_y[index])
            (loss_sum * scale).backward()
            add_batch_sums(sums, loss_sum.detach(), metrics, len(idx))
        self.optimizer.step()
        return sums

    @torch.no_grad()
    def evaluate(self, batches: Iterable[np.ndarray]) -> dict[str, float]:
        self.model.eval()
        sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
        for idx in batches:
            index = torch.from_numpy(idx)
            loss_sum, metrics = self.adapter.loss_and_metrics(
                self.model, self.test_x[index], self.test_y[index], training=False)
            add_batch_sums(sums, loss_sum.detach(), metrics, len(idx))
        self.model.train()
        return sums

    def start_allreduce_sums(self, sums: dict[str, float]) -> Callable[[], dict[str, float]]:
        keys = sorted(sums)
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        handle = hvd.allreduce_async(values, op=hvd.Sum, name="hvdtrain.sums")
        return lambda: dict(zip(keys, hvd.synchronize(handle).tolist()))

    def write_checkpoint(self, fileobj: IO[bytes], meta: dict[str, Any]) -> None:
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "meta": meta}, fileobj)

    def read_checkpoint(self, path: Path) -> dict[str, Any]:
        # weights_only: loading a checkpoint must never execute code from the file.
        state = torch.load(path, map_location="cpu", weights_only=True)
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError) as exc:
            first = str(exc).strip().splitlines()
            raise HvdtrainError(f"checkpoint {path} does not fit the model: "
                                f"{' '.join(line.strip() for line in first[:3])}") from None
        return state["meta"]

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: p.detach().cpu().numpy().copy() for name, p in self.model.named_parameters()}

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "horovod": horovod.__version__}
