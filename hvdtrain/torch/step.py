"""The PyTorch kernels of the train step (:mod:`hvdtrain.step` runs the sequence)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from hvdtrain.adapters import ModelAdapter
from hvdtrain.data.sampler import StepIndices
from hvdtrain.step import StepKernels
from hvdtrain.torch.data import TorchLoader
from hvdtrain.torch.precision import Precision


class TorchKernels(StepKernels):
    """Forward, backward and update of one ``torch.nn.Module`` with its optimizer and loader."""

    precision: Precision  # the skeleton's PrecisionKernels, and the backward pass's scaling

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 adapter: ModelAdapter, data: TorchLoader, precision: Precision) -> None:
        self.model, self.optimizer, self.adapter = model, optimizer, adapter
        self.data, self.precision = data, precision
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.lr = float("nan")  # the loop sets the real one before the first step

    def set_lr(self, lr: float) -> None:
        if lr != self.lr:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.lr = lr

    def batches(self, step: StepIndices) -> Iterator[Any]:
        return self.data.batches(step)

    def begin(self) -> None:
        self.optimizer.zero_grad()

    def backward(self, batch: Any, weight: float, last: bool) -> tuple[Any, dict[str, Any]]:
        x, y = batch
        loss_sum, metrics = self.adapter.loss_and_metrics(self.model, x, y)
        self.precision.backward(loss_sum, weight)
        return loss_sum.detach(), metrics

    def gradients(self) -> list[torch.Tensor]:
        own = getattr(self.optimizer, "gradients", None)
        if own is not None:  # shard.stage 2-3: the optimizer holds its shards' gradients
            return list(own())
        grads = []
        for p in self.params:
            if p.grad is None:  # a parameter this step did not reach still takes part
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        return grads
