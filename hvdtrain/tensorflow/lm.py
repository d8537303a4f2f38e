"""The built-in causal language model in Keras 3 (``model.name: gpt``), a GPT-style decoder.

The same model as ``hvdtrain/torch/lm.py``, layer for layer: an ordered list of layers, each taking
one tensor and returning one (:class:`Embeddings`: tokens ``[B, T]`` -> hidden ``[B, T, d]``;
``layers`` x :class:`Block`: hidden -> hidden; :class:`Head`: hidden -> logits
``[B, T, vocab]``), so ``keras.Sequential([keras.Input((T,), "int64"), *layers])`` is the model.
Each sub-layer carries the name of the PyTorch attribute it mirrors (``qkv``, ``proj``, ``ln1``,
...), a ``Dense`` kernel being the transpose of a ``Linear`` weight; the initial distributions, the
exact GELU and LayerNorm's epsilon of 1e-5 are PyTorch's, so given the same weights the two
models compute the same logits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar

import keras
import tensorflow as tf
from keras import ops

from hvdtrain.adapters import ModelAdapter
from hvdtrain.data.contracts import DatasetSpec
from hvdtrain.lm import DERIVED_METRICS, INIT_STD, GptOptions, GptShape, gpt_shape, residual_std


def _dense(units: int, std: float, name: str, use_bias: bool = True) -> keras.layers.Dense:
    return keras.layers.Dense(units, use_bias=use_bias, name=name,
                              kernel_initializer=keras.initializers.RandomNormal(0.0, std),
                              bias_initializer="zeros")


def _layer_norm(name: str) -> keras.layers.LayerNormalization:
    return keras.layers.LayerNormalization(epsilon=1e-5, name=name)  # PyTorch's epsilon


class Embeddings(keras.layers.Layer):
    """Token ids ``[B, T]`` -> the sum of token and position embeddings ``[B, T, d]``."""

    def __init__(self, shape: GptShape, d_model: int, dropout: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        init = keras.initializers.RandomNormal(0.0, INIT_STD)
        self.tokens = keras.layers.Embedding(shape.vocab_size, d_model, embeddings_initializer=init,
                                             name="tokens")
        self.positions = keras.layers.Embedding(shape.context, d_model,
                                                embeddings_initializer=init, name="positions")
        self.drop = keras.layers.Dropout(dropout)

    def call(self, tokens: Any, training: bool | None = None) -> Any:
        positions = self.positions(ops.arange(ops.shape(tokens)[1]))
        return self.drop(self.tokens(tokens) + positions, training=training)


class Block(keras.layers.Layer):
    """One pre-LayerNorm transformer block: ``x + attention(ln1(x))``, then ``x + mlp(ln2(x))``;
    causal attention over ``heads`` heads, as :class:`hvdtrain.torch.lm.Block`."""

    def __init__(self, d_model: int, heads: int, dropout: float, layers: int,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.heads, self.d_model = heads, d_model
        # In the order of the PyTorch block's parameters, which the variables then follow.
        self.ln1 = _layer_norm("ln1")
        self.qkv = _dense(3 * d_model, INIT_STD, "qkv")
        self.proj = _dense(d_model, residual_std(layers), "proj")  # into the residual stream
        self.ln2 = _layer_norm("ln2")
        self.fc = _dense(4 * d_model, INIT_STD, "fc")
        self.out = _dense(d_model, residual_std(layers), "out")
        self.attn_drop = keras.layers.Dropout(dropout)
        self.drop = keras.layers.Dropout(dropout)

    def _heads(self, x: Any) -> Any:
        """``[B, T, d]`` -> ``[B, heads, T, d / heads]``."""
        steps = ops.shape(x)[1]
        return ops.transpose(ops.reshape(x, (-1, steps, self.heads, self.d_model // self.heads)),
                             (0, 2, 1, 3))

    def attention(self, x: Any, training: bool | None) -> Any:
        """Causal multi-head self-attention of ``x`` ``[B, T, d]``."""
        q, k, v = (self._heads(part) for part in ops.split(self.qkv(x), 3, axis=-1))
        steps = ops.shape(x)[1]
        scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2)))
        scores = scores / ops.cast(math.sqrt(self.d_model // self.heads), scores.dtype)
        causal = ops.tril(ops.ones((steps, steps), "bool"))
        scores = ops.where(causal, scores, ops.cast(-math.inf, scores.dtype))
        weights = self.attn_drop(ops.softmax(scores, axis=-1), training=training)
        y = ops.reshape(ops.transpose(ops.matmul(weights, v), (0, 2, 1, 3)),
                        (-1, steps, self.d_model))
        return self.drop(self.proj(y), training=training)

    def call(self, x: Any, training: bool | None = None) -> Any:
        x = x + self.attention(self.ln1(x), training)
        mlp = self.out(keras.activations.gelu(self.fc(self.ln2(x)), approximate=False))
        return x + self.drop(mlp, training=training)


class Head(keras.layers.Layer):
    """Hidden ``[B, T, d]`` -> logits ``[B, T, vocab]``: the final LayerNorm and a dense layer
    without bias."""

    def __init__(self, shape: GptShape, d_model: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ln = _layer_norm("ln")
        self.logits = _dense(shape.vocab_size, INIT_STD, "logits", use_bias=False)

    def call(self, x: Any) -> Any:
        return self.logits(self.ln(x))


class GPT(ModelAdapter):
    """A GPT-style causal language model for token windows (``data.name: text``), the Keras twin of
    :class:`hvdtrain.torch.lm.GPT`: the same options, loss and metrics."""

    derived_metrics: ClassVar[dict[str, Callable[..., float]]] = DERIVED_METRICS

    def __init__(self, **options: Any) -> None:
        self.config = GptOptions.of(options)
        super().__init__(**options)

    def layers(self, spec: DatasetSpec) -> list[Callable[[], keras.layers.Layer]]:
        """One factory per layer, in order: the embeddings, each block, the head. A layer builds
        its weights on its first call (or ``layer.build(input_shape)``): tokens ``(None, T)`` for
        the embeddings, ``(None, T, d_model)`` for the others."""
        o, shape = self.config, gpt_shape(self.config, spec)
        blocks = [functools.partial(Block, o.d_model, o.heads, o.dropout, o.layers)] * o.layers
        return [functools.partial(Embeddings, shape, o.d_model, o.dropout), *blocks,
                functools.partial(Head, shape, o.d_model)]

    def build(self, spec: DatasetSpec) -> keras.Model:
        steps = gpt_shape(self.config, spec).seq_len
        return keras.Sequential([keras.Input((steps,), dtype="int64"),
                                 *(make() for make in self.layers(spec))])

    def output_loss(self, output: Any, y: tf.Tensor, training: bool = True
                    ) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        """The loss sum and metric sums of the last layer's logits ``output`` ``[B, T, vocab]``
        against the next tokens ``y`` ``[B, T]``: per sequence, the mean over its tokens."""
        logits = tf.cast(output, tf.float32)  # under a mixed policy the logits are bf16 or fp16
        losses = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        right = tf.cast(tf.equal(tf.argmax(logits, axis=-1), tf.cast(y, tf.int64)), tf.float32)
        return (tf.reduce_sum(tf.reduce_mean(losses, axis=1)),
                {"token_accuracy": tf.reduce_sum(tf.reduce_mean(right, axis=1))})

    def loss_and_metrics(self, model: keras.Model, x: tf.Tensor, y: tf.Tensor,
                         training: bool = True) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        return self.output_loss(model(x, training=training), y, training)
