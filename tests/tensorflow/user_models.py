"""A user's own Keras models, plugged in by import path the way a user would."""

import keras

from hvdtrain.tensorflow import ClassifierAdapter


def tiny_net(spec, width: int = 32) -> keras.Model:
    """A plain factory function: hvdtrain wraps it in the classification adapter."""
    return keras.Sequential([keras.Input(shape=spec.input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(width, activation="tanh"),
                             keras.layers.Dense(spec.num_classes)])


class WideNet(ClassifierAdapter):
    """An adapter subclass with its own option."""

    def __init__(self, width: int = 256) -> None:
        super().__init__(width=width)
        self.width = width

    def build(self, spec) -> keras.Model:
        return tiny_net(spec, self.width)
