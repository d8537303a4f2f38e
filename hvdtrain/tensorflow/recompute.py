"""Activation checkpointing for Keras models (``model.activation_checkpointing=true``).

Each unit (one of the model's layers, ``model.layers``: the units of ``shard.stage=2``,
:func:`hvdtrain.tensorflow.shard_grads.layer_units`) runs its forward pass under
``tf.recompute_grad``: its inner activations are not kept for the backward pass but computed
again from its input when the backward pass reaches it. Memory falls to the units' inputs plus one
unit's activations, for one more forward pass.

A unit's forward pass may change its non-trainable variables: a ``Dropout``'s seed generator
advances, a ``BatchNormalization`` moves its statistics. The recompute would advance them a
second time and draw other random numbers than the forward pass did, so that the gradients would
not be those of the loss. Before each run of the unit (the forward pass and the recompute) they are
set back to what they held before the forward pass: the recompute draws the same numbers, and
the state ends where one forward pass leaves it.

``tf.custom_gradient`` takes keyword arguments in eager mode only; the traced step passes
``training`` (and masks) by closure instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf


def recompute_units(model: keras.Model) -> int:
    """Wraps the ``call`` of each of ``model.layers`` that computes anything (not an input) so
    that it is recomputed in the backward pass; returns how many were wrapped."""
    wrapped = 0
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        layer.call = _recomputed(layer.call, _state(layer))
        wrapped += 1
    return wrapped


def _state(layer: Any) -> list[Any]:
    """The tf.Variables a forward pass of ``layer`` may assign: its and its sublayers'
    non-trainable variables and seed generators' states."""
    found: dict[int, Any] = {}
    for sub in layer._flatten_layers(include_self=True, recursive=True):
        for v in [*sub.non_trainable_variables,
                  *(sg.state for sg in getattr(sub, "_seed_generators", []))]:
            found.setdefault(id(v), v)
    return list(found.values())


def _recomputed(call: Callable[..., Any], state: list[Any]) -> Callable[..., Any]:
    """``call`` under ``tf.recompute_grad``, with ``state`` set back before every run."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before = [tf.identity(v.value) for v in state]

        def forward(*inputs: Any) -> Any:
            for v, value in zip(state, before, strict=True):
                v.assign(value)  # a no-op in the forward pass; the recompute starts from here
            return call(*inputs, **kwargs)

        return tf.recompute_grad(forward)(*args)

    return wrapped
