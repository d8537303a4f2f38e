"""PyTorch model adapters: a classification base class and the built-in ``mlp``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.adapters import ModelAdapter
from hvdtrain.data import DatasetSpec
from hvdtrain.errors import HvdtrainError


class ClassifierAdapter(ModelAdapter):
    """Cross-entropy loss and accuracy for a model that maps inputs to class logits.

    Subclass it and implement :meth:`build` to plug in your own ``nn.Module``::

        class MyNet(ClassifierAdapter):
            def build(self, spec):
                return nn.Sequential(nn.Flatten(), nn.Linear(64, spec.num_classes))

    and name it in the config: ``model.name: mypackage.models:MyNet``.
    """

    def loss_and_metrics(self, model: nn.Module, x: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = model(x)
        loss_sum = F.cross_entropy(logits, y, reduction="sum")
        correct = (logits.argmax(dim=1) == y).sum()
        return loss_sum, {"correct": correct}


class MLP(ClassifierAdapter):
    """A multi-layer perceptron: ``hidden`` sizes with ReLU between them (options: ``hidden``)."""

    def __init__(self, hidden: list[int] | tuple[int, ...] = (128,), **options: Any) -> None:
        super().__init__(hidden=list(hidden), **options)
        if not hidden or not all(isinstance(h, int) and h > 0 for h in hidden):
            raise HvdtrainError(f"model.options.hidden={hidden!r}: expected a list of positive integers")
        if options:
            raise HvdtrainError(f"model.options: unknown option(s) for mlp: {', '.join(options)}")
        self.hidden = list(hidden)

    def build(self, spec: DatasetSpec) -> nn.Module:
        width = 1
        for dim in spec.input_shape:
            width *= dim
        layers: list[nn.Module] = [nn.Flatten()]
        for size in self.hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, spec.num_classes))
        return nn.Sequential(*layers)
