"""Mixed precision for the PyTorch engine: ``torch.autocast`` for bf16 and fp16, and for fp16 a
``GradScaler`` combined with either gradient exchange (policy in :mod:`hvdtrain.precision`).

With Horovod's ``DistributedOptimizer`` the order is Horovod's documented one: ``synchronize()``
(the allreduce of the scaled gradients), ``unscale_``, then ``step`` inside ``skip_synchronize()``
so that gradients are reduced once. An overflow on any rank reaches every rank through that
average, so all ranks skip the same steps.

With hvdtrain's own exchange (top-k, QSGD, ...) the gradients are unscaled *before* the exchange,
so that error-feedback residuals stay in the gradients' own units whatever the scale does; the
ranks first agree by one allreduce whether any of them overflowed, and then all skip the step
(and leave the residuals alone) or all take it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Sequence

import horovod.torch as hvd
import torch

from hvdtrain.adapters import ModelAdapter
from hvdtrain.data.contracts import DatasetSpec
from hvdtrain.torch.device import to_device

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """One rank's precision: the autocast context, the loss scaler and the optimizer step."""

    def __init__(self, precision: str, device: torch.device) -> None:
        self.device_type = device.type
        self.dtype = DTYPES.get(precision)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.skipped = False
        """Whether the last step was skipped by the loss scaler (an fp16 overflow)."""

    def autocast(self) -> ContextManager[Any]:
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
        else:
            loss.backward(torch.full_like(loss, weight))

    def step_horovod(self, optimizer: Any) -> float:
        """Horovod's ``DistributedOptimizer`` step: reduce once, unscale, step; returns the seconds
        spent waiting for the allreduce."""
        waited = time.perf_counter()
        optimizer.synchronize()
        comm_s = time.perf_counter() - waited
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        with optimizer.skip_synchronize():
            self._step(optimizer)
        return comm_s

    def step_exchange(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter],
                      exchange: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> bool:
        """hvdtrain's exchange and the step: unscale (fp16), exchange, step. Returns whether the
        exchange ran (it does not when any rank overflowed: every rank then skips the step)."""
        if self.scaler is not None and self._overflow_anywhere(params):
            for p in params:  # the scaler sees the overflow on this rank too, and skips with the others
                p.grad.fill_(float("inf"))
            self._step(optimizer)
            return False
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        for p, averaged in zip(params, exchange([p.grad for p in params])):
            p.grad = averaged
        self._step(optimizer)
        return True

    @staticmethod
    def _overflow_anywhere(params: Sequence[torch.nn.Parameter]) -> bool:
        local = torch.stack([torch.isfinite(p.grad).all() for p in params]).all()
        flag = torch.tensor([0.0 if bool(local) else 1.0])
        return float(hvd.allreduce(flag, op=hvd.Sum, name="hvdtrain.fp16_overflow")) > 0

    def _step(self, optimizer: Any) -> None:
        if self.scaler is None:
            optimizer.step()
            self.skipped = False
            return
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # The scale falls only when the step was skipped (it rises after a run of good steps).
        self.skipped = self.scaler.get_scale() < before

    def state_dict(self) -> dict[str, Any] | None:
        """The loss scaler's state for checkpoints (None without one)."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restores :meth:`state_dict`'s output; a checkpoint without one keeps the fresh scaler."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


class PlacedAdapter(ModelAdapter):
    """A model adapter whose batches go to the rank's device and whose forward pass runs under the
    precision's autocast: the engine's training and evaluation use it unchanged on CPU and GPU."""

    def __init__(self, inner: ModelAdapter, device: torch.device, precision: Precision) -> None:
        super().__init__(**inner.options)
        self.inner, self.device, self.precision = inner, device, precision

    def build(self, spec: DatasetSpec) -> torch.nn.Module:
        return self.inner.build(spec)

    def loss_and_metrics(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                         training: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x, y = to_device(self.device, x, y)
        with self.precision.autocast():
            return self.inner.loss_and_metrics(model, x, y, training=training)
