"""``hvdtrain plan profile`` for TensorFlow (Keras 3): a few steps of the config's model on one
rank, timed; the same profile as :mod:`hvdtrain.torch.plan_profile` records.

A ``tf.GradientTape`` hands back every gradient at once, so when each is ready in the backward
pass comes from the adapter's layer list run as a chain: each layer's forward pass under its own
tape, then the backward pass layer by layer from the last (``output_gradients``), as the pipeline
engine runs a stage. A layer's variables are ready when its backward pass has run. A model without
a layer list gets every gradient ready at the end of the backward pass (no overlap assumed).
"""

from __future__ import annotations

import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.adapters import make_adapter
from hvdtrain.config import Config
from hvdtrain.driver import make_dataset
from hvdtrain.horovod_start import compute_threads
from hvdtrain.plan.measure import medians, method_profiles
from hvdtrain.plan.profile import (
    LayerProfile,
    ModelProfile,
    TensorProfile,
    layer_profiles,
    model_key,
    smaller_batch,
)
from hvdtrain.registry import MODELS
from hvdtrain.tensorflow.compression import Kernels
from hvdtrain.tensorflow.engine import make_optimizer, set_threads
from hvdtrain.tensorflow.models import ClassifierAdapter


def _whole_model(adapter: Any, model: Any, opt: Any, x: tf.Tensor, y: tf.Tensor,
                 steps: int) -> tuple[list[float], list[tf.Tensor]]:
    """Median [forward, backward, update] seconds, and the last step's gradients."""
    variables = model.trainable_variables
    rows, grads = [], []
    for step in range(steps + 1):  # the first step builds and warms up
        t0 = time.perf_counter()
        with tf.GradientTape() as tape:
            loss, _ = adapter.loss_and_metrics(model, x, y, training=True)
        t1 = time.perf_counter()
        grads = tape.gradient(loss, [v.value for v in variables],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        t2 = time.perf_counter()
        opt.apply_gradients(zip(grads, variables, strict=True))
        t3 = time.perf_counter()
        if step:
            rows.append([t1 - t0, t2 - t1, t3 - t2])
    return medians(rows), grads


def _chain(adapter: Any, mods: list[Any], x: tf.Tensor,
           y: tf.Tensor) -> tuple[list[float], list[float], list[int]]:
    """Forward seconds, backward seconds and output bytes per layer, for one pass."""
    fwd, acts, tapes = [], [], []
    h = x
    for mod in mods:
        t0 = time.perf_counter()
        with tf.GradientTape() as tape:
            tape.watch(h)
            out = mod(h)
        fwd.append(time.perf_counter() - t0)
        acts.append(int(out.shape.num_elements()) * out.dtype.size)
        tapes.append((tape, h, out))
        h = out
    with tf.GradientTape() as tape:
        tape.watch(h)
        loss, _ = adapter.output_loss(h, y)
    g = tape.gradient(loss, h)
    bwd = [0.0] * len(mods)
    for i in reversed(range(len(mods))):
        t0 = time.perf_counter()
        layer_tape, inp, out = tapes[i]
        sources = [v.value for v in mods[i].trainable_variables]
        got = layer_tape.gradient(out, [*sources, inp], output_gradients=g,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
        g = got[-1]
        bwd[i] = time.perf_counter() - t0
    return fwd, bwd, acts


def _layers(adapter: Any, spec: Any, x: tf.Tensor, y: tf.Tensor, steps: int,
            small: tuple[tf.Tensor, tf.Tensor]) -> tuple[list[LayerProfile], list[Any]]:
    """The layer list's profile and its layers (built), or nothing without a layer list; each
    time with the part that the smaller batch ``small`` does not shrink (:func:`fixed_part`)."""
    factories = adapter.layers(spec)
    if not factories:
        return [], []
    mods = [f() for f in factories]
    rows = [_chain(adapter, mods, x, y) for _ in range(steps + 1)][1:]
    few = [_chain(adapter, mods, *small) for _ in range(steps + 1)][1:]
    names = [str(getattr(f, "name", i)) for i, f in enumerate(factories)]
    params = [sum(int(np.prod(v.shape)) for v in m.trainable_variables) for m in mods]
    timed = (medians([r[0] for r in rows]), medians([r[1] for r in rows]), rows[0][2])
    return layer_profiles(names, params, timed,
                          (medians([r[0] for r in few]), medians([r[1] for r in few])),
                          int(x.shape[0]), int(small[0].shape[0])), mods


def _tensors(layers: list[LayerProfile], mods: list[Any], model: Any,
             backward_s: float) -> list[TensorProfile]:
    """Each gradient in ready order: from the layer chain, else all at the backward pass's end."""
    if not mods:
        return [TensorProfile(v.path, 4 * int(np.prod(v.shape)), backward_s)
                for v in model.trainable_variables]
    out, clock = [], 0.0
    for layer, mod in zip(reversed(layers), reversed(mods), strict=True):
        clock += layer.backward_s
        out += [TensorProfile(f"{layer.name}/{v.name}", 4 * int(np.prod(v.shape)), clock)
                for v in mod.trainable_variables]
    return out


def profile_model(cfg: Config, steps: int) -> ModelProfile:
    """Profiles ``cfg``'s model on ``data.batch_size`` training samples for ``steps`` steps,
    with the compute threads one rank alone on this host would train with (``train.threads``)."""
    threads = compute_threads(cfg.train.threads, 1)
    set_threads(threads)
    dataset = make_dataset(cfg)
    adapter = make_adapter(MODELS["tensorflow"].get(cfg.model.name), cfg.model.options,
                           cfg.model.name, ClassifierAdapter)
    spec = dataset.spec()
    keras.utils.set_random_seed(cfg.seed)
    model = adapter.build(spec)
    train = dataset.train()
    batch = train.load(np.arange(min(cfg.data.batch_size, len(train))))
    x, y = tf.constant(batch.x), tf.constant(batch.y)
    few = train.load(np.arange(smaller_batch(int(x.shape[0]))))
    (fwd, bwd, upd), grads = _whole_model(adapter, model, make_optimizer(cfg.optim), x, y, steps)
    layers, mods = _layers(adapter, spec, x, y, steps, (tf.constant(few.x), tf.constant(few.y)))
    variables = model.trainable_variables
    methods = method_profiles(cfg.comm, cfg.seed, [tuple(v.shape) for v in variables],
                              [tf.reshape(g, [-1]) for g in grads], Kernels(), tf.constant, steps)
    return ModelProfile(
        model=model_key(cfg.framework, cfg.model.name, cfg.model.options),
        batch_size=int(x.shape[0]), forward_s=fwd, backward_s=bwd, update_s=upd,
        tensors=_tensors(layers, mods, model, bwd), layers=layers, compression=methods,
        source=f"measured by hvdtrain plan profile: {steps} steps, one rank, TensorFlow "
               f"{tf.__version__}, {threads} thread(s)")
