"""Mixed precision for the PyTorch engine: ``torch.autocast`` for bf16 and fp16, and for fp16 a
``GradScaler``, as the precision kernels of :mod:`hvdtrain.step` (policy in
:mod:`hvdtrain.precision`).

The order around the exchange is the step skeleton's. With Horovod's ``DistributedOptimizer``
(the dense exchange) it is Horovod's documented one: the exchange reduces the scaled gradients
(``synchronize()``), :meth:`Precision.update` unscales them and steps inside the exchange's
``skip_synchronize()``, so that gradients are reduced once; an overflow on any rank reaches every
rank through that average. Exchanges that keep state in the gradients' units get the gradients
unscaled first (:meth:`Precision.unscale`), after the ranks agreed whether any overflowed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from hvdtrain.adapters import ModelAdapter
from hvdtrain.data.contracts import DatasetSpec
from hvdtrain.step import PrecisionKernels

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision(PrecisionKernels):
    """One rank's precision: the autocast context, the loss scaler and the optimizer step.

    :meth:`attach` gives it the optimizer it steps, once that exists."""

    def __init__(self, precision: str, device: torch.device, clip_norm: float = 0.0,
                 loss_scale: float = 0.0) -> None:
        self.device_type = device.type
        self.clip_norm = clip_norm  # optim.clip_norm: 0 is off
        self.dtype = DTYPES.get(precision)
        # train.loss_scale: the first scale (0: torch's own, 2**16).
        self.scaler = (torch.amp.GradScaler(device.type, init_scale=loss_scale or 2.0 ** 16)
                       if precision == "fp16" else None)
        self.scaling = self.scaler is not None
        self.optimizer: Any = None
        self.params: list[torch.nn.Parameter] = []
        self._skipped = False

    def attach(self, optimizer: Any) -> None:
        """The optimizer :meth:`update` steps: Horovod's ``DistributedOptimizer`` or a plain one."""
        self.optimizer = optimizer
        # The parameters it updates, in the order the step's gradients come (set once: the hot path
        # reads them every step).
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward pass's context: autocast to bf16 or fp16, or nothing for fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor, weight: float = 1.0) -> None:
        """Back-propagates ``loss`` times ``weight``, scaled up first under fp16.

        Without a loss scaler the weight seeds the backward pass instead of being multiplied into
        the graph: the same gradients, one operation fewer each way."""
        if self.scaler is not None:
            self.scaler.scale(loss * weight).backward()
        elif weight == 1.0:  # torch's own seed (ones): the same gradients, no seed to validate
            loss.backward()
        else:
            loss.backward(torch.full_like(loss, weight))

    def finite(self, grads: Sequence[torch.Tensor]) -> bool:
        return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    def unscale(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # In place on the optimizer's gradients (``grads`` are those): the scaler then knows they
        # were unscaled and does not unscale them again in its step.
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        return list(grads)

    def update(self, grads: Sequence[torch.Tensor], unscaled: bool) -> None:
        for p, grad in zip(self.params, grads, strict=True):
            p.grad = grad
        if self.scaler is not None and not unscaled:
            if self._overflowed(grads):
                self.skip()  # on every rank: the ranks agreed
                return
            self.scaler.unscale_(self.optimizer)
        if self.clip_norm:
            self._clip(grads)
        self._step()

    def _overflowed(self, grads: Sequence[torch.Tensor]) -> bool:
        # A sharded optimizer's gradients are its shards: whether any rank's overflowed, decided
        # by all (a collective), so that every rank skips, or steps, as the ring's scaler does on
        # the whole average. Elsewhere the scaler sees the whole averaged gradient itself.
        overflowed = getattr(self.optimizer, "overflowed", None)
        return bool(overflowed(grads)) if overflowed is not None else False

    def _clip(self, grads: Sequence[torch.Tensor]) -> None:
        # As torch.nn.utils.clip_grad_norm_; a sharded optimizer's gradients are its shards,
        # whose norm it sums over the ranks (grad_norm, a collective).
        norm_of = getattr(self.optimizer, "grad_norm", None)
        if norm_of is not None:
            norm = norm_of(grads)
        else:
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.detach()) for g in grads]))
        factor = torch.clamp(self.clip_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.detach().mul_(factor)

    def skip(self) -> None:
        # The scaler sees an overflow on this rank too, and skips with the others.
        for p in self.params:
            if p.grad is not None:  # every one, after TorchKernels.gradients
                p.grad.fill_(float("inf"))
        self._step()

    @property
    def skipped(self) -> bool:
        return self._skipped

    def _step(self) -> None:
        if self.scaler is None:
            self.optimizer.step()
            self._skipped = False
            return
        before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        # The scale falls only when the step was skipped (it rises after a run of good steps).
        self._skipped = self.scaler.get_scale() < before

    def loss_scale(self) -> float:
        """The current loss scale (1 without loss scaling)."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def state_dict(self) -> dict[str, Any] | None:
        """The loss scaler's state for checkpoints (None without one)."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restores :meth:`state_dict`'s output; a checkpoint without one keeps the fresh scaler."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


class PlacedAdapter(ModelAdapter):
    """A model adapter whose forward pass runs under the precision's autocast (the loader has
    already placed its batches on the rank's device): the engine's training and evaluation use it
    unchanged on CPU and GPU."""

    def __init__(self, inner: ModelAdapter, device: torch.device, precision: Precision) -> None:
        super().__init__(**inner.options)
        self.inner, self.device, self.precision = inner, device, precision
        self.derived_metrics = getattr(inner, "derived_metrics", None) or {}  # for the loop

    def build(self, spec: DatasetSpec) -> torch.nn.Module:
        return self.inner.build(spec)

    def loss_and_metrics(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                         training: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with self.precision.autocast():
            return self.inner.loss_and_metrics(model, x, y, training=training)
