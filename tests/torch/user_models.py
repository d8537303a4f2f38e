"""A user's own models, plugged in by import path the way a user would."""

import os
import time

from torch import nn

from hvdtrain.torch import ClassifierAdapter


def tiny_net(spec, width: int = 32) -> nn.Module:
    """A plain factory function: hvdtrain wraps it in the classification adapter."""
    return nn.Sequential(nn.Flatten(), nn.Linear(spec.input_shape[0], width), nn.Tanh(),
                         nn.Linear(width, spec.num_classes))


class WideNet(ClassifierAdapter):
    """An adapter subclass with its own option."""

    def __init__(self, width: int = 256) -> None:
        super().__init__(width=width)
        self.width = width

    def build(self, spec) -> nn.Module:
        return tiny_net(spec, self.width)


def not_a_module(spec):
    return "this is not a model"


class NanOnRank(ClassifierAdapter):
    """The classification adapter, except that one rank's training loss turns NaN from a given
    step on (an injected fault; HOROVOD_RANK is set by horovodrun, absent in a lone process)."""

    def __init__(self, rank: int = 0, after: int = 0) -> None:
        super().__init__(rank=rank, after=after)
        self.rank, self.after, self.calls = rank, after, 0

    def build(self, spec) -> nn.Module:
        return tiny_net(spec)

    def loss_and_metrics(self, model, x, y, training: bool = True):
        loss_sum, metrics = super().loss_and_metrics(model, x, y, training)
        if training:
            self.calls += 1
            if int(os.environ.get("HOROVOD_RANK", "0")) == self.rank and self.calls > self.after:
                loss_sum = loss_sum * float("nan")
        return loss_sum, metrics


class HangOnRank(NanOnRank):
    """One rank's training batch never returns from a given step on (an injected hang)."""

    def loss_and_metrics(self, model, x, y, training: bool = True):
        if training:
            self.calls += 1
            if int(os.environ.get("HOROVOD_RANK", "0")) == self.rank and self.calls > self.after:
                time.sleep(3600)
        return ClassifierAdapter.loss_and_metrics(self, model, x, y, training)


class SlowOnRank(NanOnRank):
    """One rank spends ``delay`` extra seconds on every training batch (an injected straggler)."""

    def __init__(self, rank: int = 0, delay: float = 0.05) -> None:
        ClassifierAdapter.__init__(self, rank=rank, delay=delay)
        self.rank, self.delay, self.calls = rank, delay, 0

    def loss_and_metrics(self, model, x, y, training: bool = True):
        if training and int(os.environ.get("HOROVOD_RANK", "0")) == self.rank:
            time.sleep(self.delay)
        return ClassifierAdapter.loss_and_metrics(self, model, x, y, training)
