"""Keras 3 model adapters: a classification base class, the built-in ``mlp`` and ``resnet18``.

The ``mlp`` has the PyTorch ``mlp``'s architecture and initial weight distributions (PyTorch's
``nn.Linear`` default: weights and biases uniform in +-1/sqrt(fan_in)), so the two frameworks train
the same model.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import keras
import tensorflow as tf

from hvdtrain.adapters import Layer, ModelAdapter, classes_and_shape, mlp_hidden
from hvdtrain.data.contracts import DatasetSpec
from hvdtrain.errors import HvdtrainError


class ClassifierAdapter(ModelAdapter):
    """Cross-entropy loss and accuracy for a Keras model that maps inputs to class logits.

    Subclass it and implement :meth:`build` to plug in your own ``keras.Model``::

        class MyNet(ClassifierAdapter):
            def build(self, spec):
                return keras.Sequential([keras.Input(spec.input_shape),
                                         keras.layers.Dense(spec.num_classes)])

    and name it in the config: ``model.name: mypackage.models:MyNet``. It takes the
    classification short path's batches (one input tensor, one int64 label a sample); for other
    data (token ids, sequence targets, several inputs, no targets) subclass
    :class:`~hvdtrain.adapters.ModelAdapter` and write ``loss_and_metrics`` too.
    """

    def loss_and_metrics(self, model: keras.Model, x: tf.Tensor, y: tf.Tensor,
                         training: bool = True) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        return self.output_loss(model(x, training=training), y, training)

    def output_loss(self, output: tf.Tensor, y: tf.Tensor,
                    training: bool = True) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        """Summed cross-entropy and the number of correct predictions from the class logits."""
        # Under a mixed-precision policy the logits are bf16 or fp16: the loss is taken in float32.
        logits = tf.cast(output, tf.float32)
        losses = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        correct = tf.cast(tf.equal(tf.argmax(logits, axis=1), y), tf.float32)
        return tf.reduce_sum(losses), {"correct": tf.reduce_sum(correct)}


def _torch_like_dense(fan_in: int, units: int, activation: str | None) -> keras.layers.Dense:
    bound = 1.0 / math.sqrt(fan_in)
    return keras.layers.Dense(
        units, activation=activation,
        # kaiming_uniform(a=sqrt(5)) in torch is uniform in +-sqrt(1/fan_in): variance scaling 1/3.
        kernel_initializer=keras.initializers.VarianceScaling(1.0 / 3.0, "fan_in", "uniform"),
        bias_initializer=keras.initializers.RandomUniform(-bound, bound))


class MLP(ClassifierAdapter):
    """A multi-layer perceptron: ``hidden`` sizes with ReLU between them (options: ``hidden``)."""

    def __init__(self, hidden: list[int] | tuple[int, ...] = (128,), **options: Any) -> None:
        self.hidden = mlp_hidden(hidden, options)
        super().__init__(hidden=self.hidden)

    def build(self, spec: DatasetSpec) -> keras.Model:
        _, shape = classes_and_shape(spec, "mlp")
        return keras.Sequential([keras.Input(shape=shape), *(make() for make in self.layers(spec))])

    def layers(self, spec: DatasetSpec) -> list[Layer]:
        """``flatten``, then ``fc1``, ``fc2``, ... (with their ReLU) and ``head``: each made alone
        when called. A Keras layer draws its initializers' seeds when it is made and its weights
        when it is built, so making every layer in order and building only a stage's gives that
        stage the whole model's initial weights."""
        classes, shape = classes_and_shape(spec, "mlp")
        widths = [math.prod(shape), *self.hidden]
        layers = [Layer("flatten", keras.layers.Flatten)]
        for i, (inputs, outputs) in enumerate(itertools.pairwise(widths), start=1):
            layers.append(Layer(f"fc{i}", functools.partial(_torch_like_dense, inputs, outputs,
                                                            "relu")))
        layers.append(Layer("head", functools.partial(_torch_like_dense, widths[-1], classes, None)))
        return layers


def _conv_bn(x: Any, filters: int, kernel: int, stride: int, relu: bool) -> Any:
    """Convolution without bias, batch norm with PyTorch's epsilon and momentum, optional ReLU."""
    x = keras.layers.Conv2D(filters, kernel, stride, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization(epsilon=1e-5, momentum=0.9)(x)
    return keras.layers.ReLU()(x) if relu else x


def _basic_block(x: Any, filters: int, stride: int) -> Any:
    """ResNet's two 3x3 convolutions with a shortcut (a strided 1x1 one where the shape changes)."""
    body = _conv_bn(_conv_bn(x, filters, 3, stride, True), filters, 3, 1, False)
    same_shape = stride == 1 and x.shape[-1] == filters
    shortcut = x if same_shape else _conv_bn(x, filters, 1, stride, False)
    return keras.layers.ReLU()(keras.layers.Add()([body, shortcut]))


class ResNet18(ClassifierAdapter):
    """ResNet-18 with the layers and trainable parameter count of the PyTorch ``resnet18``, for
    images in NCHW (``synthetic_images``); option ``width`` (default 64) scales every stage's
    channels.

    The input is transposed to NHWC first: TensorFlow's CPU convolutions take channels last.
    Keras's ``same`` padding puts a strided convolution's odd pixel at the end where PyTorch
    pads both sides, and the initial weights follow Keras's defaults, so the two frameworks'
    networks are alike in size and cost, not in their numbers.
    """

    def __init__(self, width: int = 64) -> None:
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise HvdtrainError(f"model.options.width={width!r}: expected a positive integer")
        super().__init__(width=width)
        self.width = width

    def build(self, spec: DatasetSpec) -> keras.Model:
        classes, shape = classes_and_shape(spec, "resnet18")
        if len(shape) != 3:
            raise HvdtrainError(f"resnet18 needs images (channels, height, width); the dataset "
                                f"gives inputs of shape {shape}")
        inputs = keras.Input(shape=shape)
        x = keras.layers.Permute((2, 3, 1))(inputs)
        x = _conv_bn(x, self.width, 7, 2, True)
        x = keras.layers.MaxPooling2D(3, 2, padding="same")(x)
        for stage in range(4):
            filters = self.width << stage
            x = _basic_block(x, filters, 1 if stage == 0 else 2)
            x = _basic_block(x, filters, 1)
        x = keras.layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, keras.layers.Dense(classes)(x))
