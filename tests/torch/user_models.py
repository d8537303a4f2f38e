"""A user's own models, plugged in by import path the way a user would."""

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
