"""PyTorch model adapters: a classification base class and the built-in ``mlp``."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.adapters import ModelAdapter, mlp_hidden
from hvdtrain.data import DatasetSpec


class ClassifierAdapter(ModelAdapter):
    """Cross-entropy loss and accuracy for a model that maps inputs to class logits.

    Subclass it and implement :meth:`build` to plug in your own ``nn.Module``::

        class MyNet(ClassifierAdapter):
            def build(self, spec):
                return nn.Sequential(nn.Flatten(), nn.Linear(64, spec.num_classes))

    and name it in the config: ``model.name: mypackage.models:MyNet``.
    """

    def loss_and_metrics(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         training: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = model(x)
        loss_sum = F.cross_entropy(logits, y, reduction="sum")
        correct = (logits.argmax(dim=1) == y).sum()
        return loss_sum, {"correct": correct}


class MLP(ClassifierAdapter):
    """A multi-layer perceptron: ``hidden`` sizes with ReLU between them (options: ``hidden``)."""

    def __init__(self, hidden: list[int] | tuple[int, ...] = (128,), **options: Any) -> None:
        self.hidden = mlp_hidden(hidden, options)
        super().__init__(hidden=self.hidden)

    def build(self, spec: DatasetSpec) -> nn.Module:
        width = math.prod(spec.input_shape)
        layers: list[nn.Module] = [nn.Flatten()]
        for size in self.hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, spec.num_classes))
        return nn.Sequential(*layers)
