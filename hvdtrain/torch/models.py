"""PyTorch model adapters: a classification base class, the built-in ``mlp`` and ``resnet18``."""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.adapters import Layer, ModelAdapter, classes_and_shape, mlp_hidden
from hvdtrain.data.contracts import DatasetSpec
from hvdtrain.errors import HvdtrainError


class ClassifierAdapter(ModelAdapter):
    """Cross-entropy loss and accuracy for a model that maps inputs to class logits.

    Subclass it and implement :meth:`build` to plug in your own ``nn.Module``::

        class MyNet(ClassifierAdapter):
            def build(self, spec):
                return nn.Sequential(nn.Flatten(), nn.Linear(64, spec.num_classes))

    and name it in the config: ``model.name: mypackage.models:MyNet``. It takes the
    classification short path's batches (one input tensor, one int64 label a sample); for other
    data (token ids, sequence targets, several inputs, no targets) subclass
    :class:`~hvdtrain.adapters.ModelAdapter` and write ``loss_and_metrics`` too.
    """

    def loss_and_metrics(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         training: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.output_loss(model(x), y, training)

    def output_loss(self, logits: torch.Tensor, y: torch.Tensor,
                    training: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Summed cross-entropy and the number of correct predictions from the class logits."""
        loss_sum = F.cross_entropy(logits, y, reduction="sum")
        # Detached and compared in place: no autograd bookkeeping for a metric on every step.
        correct = logits.detach().argmax(dim=1).eq_(y).sum()
        return loss_sum, {"correct": correct}


class MLP(ClassifierAdapter):
    """A multi-layer perceptron: ``hidden`` sizes with ReLU between them (options: ``hidden``)."""

    def __init__(self, hidden: list[int] | tuple[int, ...] = (128,), **options: Any) -> None:
        self.hidden = mlp_hidden(hidden, options)
        super().__init__(hidden=self.hidden)

    def build(self, spec: DatasetSpec) -> nn.Module:
        return nn.Sequential(*(make() for make in self.layers(spec)))

    def layers(self, spec: DatasetSpec) -> list[Layer]:
        """``flatten``, then ``fc1``, ``relu1``, ... and ``head``: each built alone when called."""
        classes, shape = classes_and_shape(spec, "mlp")
        widths = [math.prod(shape), *self.hidden]
        layers = [Layer("flatten", nn.Flatten)]
        for i, (inputs, outputs) in enumerate(itertools.pairwise(widths), start=1):
            layers += [Layer(f"fc{i}", functools.partial(nn.Linear, inputs, outputs)),
                       Layer(f"relu{i}", nn.ReLU)]
        layers.append(Layer("head", functools.partial(nn.Linear, widths[-1], classes)))
        return layers


class _BasicBlock(nn.Module):
    """ResNet's two 3x3 convolutions with a shortcut (a strided 1x1 one where the shape changes)."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False), nn.BatchNorm2d(outputs),
            nn.ReLU(inplace=True),
            nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False), nn.BatchNorm2d(outputs))
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                                          nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


def resnet18_module(channels: int, num_classes: int, width: int = 64) -> nn.Module:
    """ResNet-18 (He et al. 2016): a 7x7/2 stem and max-pool, then [2, 2, 2, 2] basic blocks of
    ``width x (1, 2, 4, 8)`` channels, global average pooling and one linear layer.

    With ``width=64``, 3 channels and 1,000 classes it is torchvision's ``resnet18`` (11.7 M
    parameters; 11.2 M with 10 classes). The ImageNet stem keeps small images cheap: a 32x32 input
    is 8x8 after it, so one process trains it at tens of images per second on one core.
    """
    widths = [width, 2 * width, 4 * width, 8 * width]
    layers: list[nn.Module] = [
        nn.Conv2d(channels, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
        nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    inputs = width
    for stage, outputs in enumerate(widths):
        stride = 1 if stage == 0 else 2
        layers += [_BasicBlock(inputs, outputs, stride), _BasicBlock(outputs, outputs, 1)]
        inputs = outputs
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, num_classes)]
    return nn.Sequential(*layers)


class ResNet18(ClassifierAdapter):
    """ResNet-18 for images in NCHW (``synthetic_images``); option ``width`` (default 64) scales
    every stage's channels, and with them the parameters (by ``width**2``)."""

    def __init__(self, width: int = 64) -> None:
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise HvdtrainError(f"model.options.width={width!r}: expected a positive integer")
        super().__init__(width=width)
        self.width = width

    def build(self, spec: DatasetSpec) -> nn.Module:
        classes, shape = classes_and_shape(spec, "resnet18")
        if len(shape) != 3:
            raise HvdtrainError(f"resnet18 needs images (channels, height, width); the dataset "
                                f"gives inputs of shape {shape}")
        return resnet18_module(shape[0], classes, self.width)
