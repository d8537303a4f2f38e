"""The gradient exchange: the one interface through which a train step averages its gradients.

:mod:`hvdtrain.step` hands every step's local gradients to one :class:`GradientExchange` and
steps the optimizer with what comes back. Which exchange a run gets is decided here, once, from
the config (:func:`exchange_kind`); each framework package builds it (``exchange.py`` in
``hvdtrain/torch`` and ``hvdtrain/tensorflow``, the same names in both):

- ``dense``: Horovod's allreduce of every gradient, sent as float32 or float16 (``none``,
  ``fp16``). In PyTorch it is Horovod's ``DistributedOptimizer``, whose backward hooks start the
  allreduce while the backward pass still runs; in TensorFlow it can be traced into the step
  (:attr:`GradientExchange.fusable`).
- ``compressing``: a method's framework-free plan (:mod:`hvdtrain.compression.exchange`) run with
  the framework's kernels and Horovod's collectives, once per step after the micro-batches.
- ``ps`` (``comm.topology=ps``): the flat gradient pushed to parameter servers and its sum pulled
  back (:mod:`hvdtrain.ps.exchange`; ``ps.py`` in each framework package), averaging over the
  workers.

The interface leaves room for what moves gradients differently: a parameter server's push and
pull, or a pipeline stage's allreduce within its Horovod process set, are further kinds with the
same methods, averaging over their own group of ranks.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from hvdtrain.compression import PLANS


def exchange_kind(compression: str, topology: str = "ring") -> str:
    """The exchange that ``comm.compression`` and ``comm.topology`` need: ``ps`` for parameter
    servers; on the ring ``dense`` when the method's plan sends every tensor dense (Horovod's own
    allreduce carries it), else ``compressing``."""
    if topology == "ps":
        return "ps"
    return "dense" if PLANS.get(compression).dense else "compressing"


def empty_stats() -> dict[str, float]:
    """The measurements of a step that sent nothing."""
    return {"wire_bytes": 0.0, "dense_bytes": 0.0, "comm_s": 0.0, "compress_s": 0.0}


class GradientExchange(abc.ABC):
    """Averages one step's gradients over the ranks that hold copies of them.

    Every method is called on every rank of the exchange's group in the same order; the ones
    that say "a collective" communicate.
    """

    unscaled_first: bool = False
    """Whether the gradients must be unscaled (fp16) before :meth:`run`: true for exchanges that
    keep state in the gradients' units (error-feedback residuals, PowerSGD's ``Q``). The ranks then
    agree by :meth:`any_rank` whether any overflowed, and all skip that step together."""

    fusable: bool = False
    """Whether a framework may trace :meth:`run` into its step function (TensorFlow's fused
    dense step); :meth:`note_fused` then stands in for :meth:`run`'s bookkeeping."""

    rank: int
    size: int
    """This rank's place and the size of the group the exchange averages over."""

    stats: dict[str, float]
    """The last step's ``wire_bytes`` (handed to Horovod), ``dense_bytes`` (the float32 bytes they
    stand for; both 0 when nothing was sent), ``comm_s`` (waiting for the collectives) and
    ``compress_s`` (the exchange's own kernels)."""

    def backward_starts(self, last: bool) -> None:
        """Before each micro-batch's backward pass; ``last``: the step's last, whose gradients
        :meth:`run` gets (an exchange may start sending them as the pass produces them)."""

    @abc.abstractmethod
    def run(self, grads: Sequence[Any]) -> list[Any]:
        """The average over the ranks of each gradient, in the model's order (a collective)."""

    def note_fused(self, comm_s: float) -> None:
        """Records a step whose exchange a framework traced into its step (:attr:`fusable`)."""
        raise NotImplementedError(f"{type(self).__name__} is not fusable")

    @abc.abstractmethod
    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank of the group (a collective)."""

    def updating(self) -> AbstractContextManager[Any]:
        """The context the optimizer update runs in after :meth:`run` (Horovod's
        ``DistributedOptimizer`` must not reduce again inside its own ``step``)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def resize(self, rank: int, size: int, accumulation: int) -> None:
        """Continues as ``rank`` of ``size`` ranks, exchanging once every ``accumulation``
        micro-batches (elastic mode)."""

    def gather(self) -> None:
        """Collects every rank's own state onto every rank before a checkpoint (a collective)."""

    def state_dict(self) -> dict[str, np.ndarray] | None:
        """The checkpoint entry (NumPy arrays), or None for an exchange without state."""
        return None

    def load_state_dict(self, entry: Mapping[str, Any] | None, where: str) -> None:
        """Restores :meth:`state_dict`'s entry; ``where`` names its file in errors."""

    def broadcast(self, root_rank: int = 0) -> None:
        """Gives every rank the root's state, re-sharded to the current world (a collective)."""

    def finish(self) -> None:
        """After a training's last step, on every rank (a parameter server's workers tell the
        servers they are done)."""
