"""``hvdtrain plan profile`` for PyTorch: a few steps of the config's model on one rank, timed.

Records what :mod:`hvdtrain.plan.profile` describes: the forward, backward and update times; when
each parameter's gradient is ready in the backward pass (``register_post_accumulate_grad_hook``);
per layer of the adapter's layer list, its forward and backward time (hooks on each layer's output
gradient) and its output's bytes; and each compression method's ratio (its plan's byte counts) and
kernel time (the method's compression kernels on the step's gradients). No Horovod: one process.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

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
from hvdtrain.torch.compression import Kernels
from hvdtrain.torch.data import _as_tensors
from hvdtrain.torch.engine import make_optimizer
from hvdtrain.torch.models import ClassifierAdapter


def _whole_model(adapter: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, x: Any, y: Any,
                 steps: int) -> tuple[list[float], list[float]]:
    """Median [forward, backward, update] seconds, and each parameter's ready time."""
    params = [p for p in model.parameters() if p.requires_grad]
    ready = [0.0] * len(params)
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(
            lambda _p, i=i: ready.__setitem__(i, time.perf_counter()))
    times, readies = [], []
    for step in range(steps + 1):  # the first step warms up
        t0 = time.perf_counter()
        loss, _ = adapter.loss_and_metrics(model, x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        if step:
            times.append([t1 - t0, t2 - t1, t3 - t2])
            readies.append([r - t1 for r in ready])
    return medians(times), medians(readies)


def _layers(adapter: Any, spec: Any, x: Any, y: Any, steps: int,
            small: tuple[Any, Any], sizes: tuple[int, int]) -> list[LayerProfile]:
    """The layer list's profile at the batch ``x``, with the part of each time that the smaller
    batch ``small`` does not shrink (:func:`fixed_part`); ``sizes``: both batches' samples."""
    factories = adapter.layers(spec)
    if not factories:
        return []
    mods = [f() for f in factories]
    names = [str(getattr(f, "name", i)) for i, f in enumerate(factories)]
    params = [sum(p.numel() for p in m.parameters()) for m in mods]
    return layer_profiles(names, params, _timed_layers(adapter, mods, x, y, steps),
                          _timed_layers(adapter, mods, *small, steps)[:2], *sizes)


def _timed_layers(adapter: Any, mods: list[torch.nn.Module], x: Any, y: Any,
                  steps: int) -> tuple[list[float], list[float], list[int]]:
    """Median forward and backward seconds per layer over ``steps`` passes after one untimed,
    and each layer's output bytes."""
    rows = [_time_layers(adapter, mods, x, y) for _ in range(steps + 1)][1:]
    return medians([r[0] for r in rows]), medians([r[1] for r in rows]), rows[0][2]


def _time_layers(adapter: Any, mods: list[torch.nn.Module], x: Any,
                 y: Any) -> tuple[list[float], list[float], list[int]]:
    """Forward seconds, backward seconds and output bytes per layer, for one pass."""
    fwd, acts, grad_at = [], [], [0.0] * len(mods)
    h = x
    for i, mod in enumerate(mods):
        t0 = time.perf_counter()
        h = mod(h)
        fwd.append(time.perf_counter() - t0)
        acts.append(h.numel() * h.element_size())
        if h.requires_grad:
            h.register_hook(lambda g, i=i: grad_at.__setitem__(i, time.perf_counter()))
    loss, _ = adapter.output_loss(h, y)
    start = time.perf_counter()
    loss.backward()
    end = time.perf_counter()
    # Layer i's backward runs from its output's gradient to its input's (layer i-1's output).
    begins = [g or start for g in grad_at]
    finishes = [(grad_at[i - 1] or end) if i else end for i in range(len(mods))]
    bwd = [max(0.0, f - b) for b, f in zip(begins, finishes, strict=True)]
    for mod in mods:
        mod.zero_grad()
    return fwd, bwd, acts


def profile_model(cfg: Config, steps: int) -> ModelProfile:
    """Profiles ``cfg``'s model on ``data.batch_size`` training samples for ``steps`` steps,
    with the compute threads one rank alone on this host would train with (``train.threads``)."""
    torch.set_num_threads(compute_threads(cfg.train.threads, 1))
    dataset = make_dataset(cfg)
    adapter = make_adapter(MODELS["torch"].get(cfg.model.name), cfg.model.options, cfg.model.name,
                           ClassifierAdapter)
    spec = dataset.spec()
    torch.manual_seed(cfg.seed)
    model = adapter.build(spec)
    opt = make_optimizer(cfg.optim, model)
    train = dataset.train()
    batch = train.load(np.arange(min(cfg.data.batch_size, len(train))))
    x, y = _as_tensors(batch.x, batch.y)
    rows = len(batch.x) if hasattr(batch.x, "__len__") else cfg.data.batch_size
    small = train.load(np.arange(smaller_batch(rows)))
    (fwd, bwd, upd), ready = _whole_model(adapter, model, opt, x, y, steps)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    tensors = sorted((TensorProfile(n, 4 * p.numel(), r) for n, p, r in
                      zip(names, params, ready, strict=True)), key=lambda t: t.ready_s)
    loss, _ = adapter.loss_and_metrics(model, x, y)
    loss.backward()  # gradients for the compression kernels
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten()
             for p in params]
    methods = method_profiles(cfg.comm, cfg.seed, [tuple(p.shape) for p in params], grads,
                              Kernels(), torch.from_numpy, steps)
    return ModelProfile(
        model=model_key(cfg.framework, cfg.model.name, cfg.model.options),
        batch_size=rows,
        forward_s=fwd, backward_s=bwd, update_s=upd, tensors=tensors,
        layers=_layers(adapter, spec, x, y, steps, _as_tensors(small.x, small.y),
                       (rows, smaller_batch(rows))),
        compression=methods,
        source=f"measured by hvdtrain plan profile: {steps} steps, one rank, PyTorch "
               f"{torch.__version__}, {torch.get_num_threads()} thread(s)")
