"""One train step, written once for every framework and every gradient exchange.

:func:`train_step` is the sequence a step runs; a framework supplies the kernels only
(:class:`StepKernels`, with its :class:`PrecisionKernels`), and the gradients travel through one
:class:`~hvdtrain.exchange.GradientExchange`:

1. the learning rate, then zeroed gradient buffers;
2. per micro-batch: its batch (the wait for it is ``data_s``), the forward and backward pass with
   the loss weighted by ``size / global_count``, so that the exchange's average over ranks is the
   mean over the step's samples even when ranks hold unequal shares; local gradients accumulate.
   The exchange is told before each backward pass whether it is the step's last
   (:meth:`~hvdtrain.exchange.GradientExchange.backward_starts`), so that it may start sending
   the gradients that pass finishes while the rest are still computed;
3. the gradient exchange, once per step after the last micro-batch (as Horovod's
   ``backward_passes_per_step`` does). Under fp16 an exchange that keeps state in the gradients'
   units gets them unscaled, after the ranks agreed whether any overflowed (then all skip the
   step, leaving that state alone); other exchanges average the scaled gradients, which carries an
   overflow to every rank by itself;
4. the update through the precision's loss scaler, which skips a step whose gradients overflowed.

A framework that can trace the last micro-batch, the exchange and the update into one function
(TensorFlow, for exchanges that are :attr:`~hvdtrain.exchange.GradientExchange.fusable`) does so
through :meth:`StepKernels.fused_last`.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hvdtrain.data.sampler import StepIndices
from hvdtrain.exchange import GradientExchange, empty_stats


class PrecisionKernels(abc.ABC):
    """A framework's loss scaling around the exchange and the update (:mod:`hvdtrain.precision`
    is the policy). Never calls Horovod: agreement between ranks goes through the exchange."""

    scaling: bool
    """Whether the loss is scaled (fp16)."""

    @abc.abstractmethod
    def finite(self, grads: Sequence[Any]) -> bool:
        """Whether this rank's (scaled) gradients are all finite."""

    @abc.abstractmethod
    def unscale(self, grads: Sequence[Any]) -> list[Any]:
        """The gradients in their own units (divided by the loss scale)."""

    @abc.abstractmethod
    def update(self, grads: Sequence[Any], unscaled: bool) -> None:
        """Steps the optimizer with the exchanged ``grads`` (scaled unless ``unscaled``), or skips
        the step when they overflowed; the loss scale follows."""

    @abc.abstractmethod
    def skip(self) -> None:
        """Skips this step on every rank: the loss scaler counts it as an overflow."""

    @property
    @abc.abstractmethod
    def skipped(self) -> bool:
        """Whether the last step was skipped by the loss scaler."""


class StepKernels(abc.ABC):
    """What a framework supplies to :func:`train_step`: its model, optimizer and loader."""

    precision: PrecisionKernels

    @abc.abstractmethod
    def set_lr(self, lr: float) -> None:
        """Sets the optimizer's learning rate for this step."""

    @abc.abstractmethod
    def batches(self, step: StepIndices) -> Iterator[Any]:
        """This rank's loaded micro-batches of ``step``, in order."""

    @abc.abstractmethod
    def begin(self) -> None:
        """Before the first micro-batch: zeroes the accumulated gradients."""

    @abc.abstractmethod
    def backward(self, batch: Any, weight: float, last: bool) -> tuple[Any, dict[str, Any]]:
        """Forward and backward pass of one micro-batch with its summed loss times ``weight``
        (and the loss scale) as the objective; the gradients accumulate (``last``: the step's
        last micro-batch, after which :meth:`gradients` is asked). Returns the summed loss and
        metrics (framework scalars)."""

    @abc.abstractmethod
    def gradients(self) -> list[Any]:
        """The step's accumulated local gradients, one per trainable parameter, in model order."""

    def fused_last(self, batch: Any, weight: float,
                   exchange: GradientExchange) -> tuple[Any, dict[str, Any], float] | None:
        """The last micro-batch, the exchange and the update in one traced function, where this
        framework can fuse ``exchange``: its loss, metrics and the seconds waited for the
        exchange. None where it cannot (the step then runs them one by one)."""
        return None


@dataclass
class StepResult:
    """What one step returns: this rank's sums (``loss``, ``count``, metrics) and its
    measurements (:meth:`hvdtrain.engine.Step.step_stats`)."""

    sums: dict[str, float]
    stats: dict[str, float] = field(default_factory=dict)


def add_batch_sums(sums: dict[str, float], loss_sum: Any, metrics: dict[str, Any], count: int) -> None:
    """Adds one batch's summed loss and metrics (framework scalars) and its size to ``sums``."""
    sums["loss"] += float(loss_sum)
    sums["count"] += count
    for key, value in metrics.items():
        sums[key] = sums.get(key, 0.0) + float(value)


MicroBatches = Callable[[StepKernels, GradientExchange, StepIndices, float],
                        tuple[dict[str, float], float, float | None]]
"""Step 2 of the module docstring, as :func:`run_micro_batches` runs it: the kernels, the
exchange, the step and the loss weight in; the rank's sums, the seconds waited for batches and
the fused exchange's wait (or None) out. A pipeline stage runs its schedule's actions instead
(:class:`hvdtrain.pipeline.stage_step.StageRunner`)."""


def train_step(kernels: StepKernels, exchange: GradientExchange, step: StepIndices, lr: float,
               size: int, micro_batches: MicroBatches | None = None) -> StepResult:
    """Runs one optimizer step of ``size`` ranks (the copies of the model that the exchange
    averages over); see the module docstring for the sequence."""
    kernels.set_lr(lr)
    started = time.perf_counter()
    kernels.begin()
    run = micro_batches or run_micro_batches
    sums, data_s, fused_comm = run(kernels, exchange, step, size / step.global_count)
    if fused_comm is None:
        stats = exchange_and_update(kernels, exchange)
    else:
        exchange.note_fused(fused_comm)
        stats = dict(exchange.stats)
    stats["data_s"] = data_s
    stats["compute_s"] = time.perf_counter() - started - data_s - stats["comm_s"]
    stats["skipped"] = float(kernels.precision.skipped)
    return StepResult(sums, stats)


def run_micro_batches(kernels: StepKernels, exchange: GradientExchange, step: StepIndices,
                      weight: float) -> tuple[dict[str, float], float, float | None]:
    """Step 2 of the module docstring: this rank's sums, the seconds it waited for batches, and
    the seconds waited for the exchange where the last micro-batch fused it (else None)."""
    sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
    data_s, fused_comm = 0.0, None
    batches = kernels.batches(step)
    last = len(step.micro) - 1
    for i, idx in enumerate(step.micro):
        waited = time.perf_counter()
        batch = next(batches)
        data_s += time.perf_counter() - waited
        fused = kernels.fused_last(batch, weight, exchange) if i == last else None
        if fused is None:
            exchange.backward_starts(i == last)
            loss_sum, metrics = kernels.backward(batch, weight, i == last)
        else:
            loss_sum, metrics, fused_comm = fused
        add_batch_sums(sums, loss_sum, metrics, len(idx))
    return sums, data_s, fused_comm


def exchange_and_update(kernels: StepKernels, exchange: GradientExchange) -> dict[str, float]:
    """Step 3 and 4 of the module docstring; returns the exchange's measurements."""
    precision, grads = kernels.precision, kernels.gradients()
    unscaled = precision.scaling and exchange.unscaled_first
    if unscaled:
        if exchange.any_rank(not precision.finite(grads)):
            precision.skip()
            return empty_stats()
        grads = precision.unscale(grads)
    averaged = exchange.run(grads)
    with exchange.updating():
        precision.update(averaged, unscaled)
    return dict(exchange.stats)
