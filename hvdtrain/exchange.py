"""The gradient exchange: the one interface through which a train step averages its gradients.

:mod:`hvdtrain.step` hands every step's local gradients to one :class:`GradientExchange` and
steps the optimizer with what comes back. Which exchange a run gets is decided here, once, from
the config: the strategies' registry names, per framework, the factory of each kind
(:attr:`hvdtrain.strategies.base.Strategy.exchanges`), :func:`build_exchange` resolves it, and
:func:`exchange_kind` names it. Every factory takes one :class:`ExchangeRequest` and returns
(exchange, optimizer) in both frameworks (:class:`hvdtrain.frameworks.ExchangeFactory`):

- ``dense``: Horovod's allreduce of every gradient, sent as float32 or float16 (``none``,
  ``fp16``). In PyTorch it is Horovod's ``DistributedOptimizer``, whose backward hooks start the
  allreduce while the backward pass still runs; in TensorFlow it can be traced into the step
  (:attr:`GradientExchange.fusable`).
- ``compressing``: a method's framework-free plan (:mod:`hvdtrain.compression.exchange`) run with
  the framework's kernels and Horovod's collectives, once per step after the micro-batches.
- ``ps`` (``comm.topology=ps``): the flat gradient pushed to parameter servers and its sum pulled
  back (:mod:`hvdtrain.ps.exchange`; ``ps.py`` in each framework package), averaging over the
  workers; ``ps-optimizer`` under ``ssp``/``asp``, where the servers run the optimizer.
- ``sharded`` (``shard.stage`` >= 1): reduce-scatter, update of this rank's shard, allgather.

The interface leaves room for what moves gradients differently: a parameter server's push and
pull, or a pipeline stage's allreduce within its Horovod process set, are further kinds with the
same methods, averaging over their own group of ranks.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Any

import numpy as np

from hvdtrain.strategies.table import exchange_of, exchange_path

if TYPE_CHECKING:
    from hvdtrain.compression.plans import CommSettings
    from hvdtrain.compression.rules import OptimizerSettings
    from hvdtrain.config import PSConfig, ShardConfig
    from hvdtrain.layout import Layout


def exchange_kind(cfg: Any) -> str:
    """The kind of exchange ``cfg`` trains with, read from the strategies' registry
    (:func:`hvdtrain.strategies.table.exchange_of`): ``dense``, ``compressing`` (the ring),
    ``ps``, ``ps-optimizer`` (parameter servers), ``sharded``."""
    return exchange_of(cfg).name


@dataclass(frozen=True)
class ExchangeRequest:
    """What an exchange factory (:class:`hvdtrain.frameworks.ExchangeFactory`) builds from: the
    same fields for both frameworks; the framework's own objects are typed ``Any`` here."""

    comm: CommSettings
    """The ``comm`` section (the method and its settings)."""
    seed: int
    """The run's seed: the methods' random draws start from it."""
    rank: int
    size: int
    """This rank's place among the ranks the exchange averages over, and their number (a
    pipeline stage's: its copy and the copies)."""
    params: Sequence[Any]
    """The trainable parameters in the model's order (``torch.nn.Parameter``, TensorFlow
    variables): the gradients the exchange gets have their shapes."""
    optimizer: Any = None
    """The run's optimizer as the engine made it (PyTorch's over ``params``; Keras's, not yet
    built or wrapped for loss scaling). The factory returns the one the step drives."""
    settings: OptimizerSettings | None = None
    """What an update rule needs of the optimizer (TensorFlow's engines say; PyTorch's factories
    read it from ``optimizer``)."""
    model: Any = None
    """The whole model where the exchange needs it (Horovod's ``DistributedOptimizer`` takes
    its named parameters)."""
    accumulation: int = 1
    """Micro-batches a step exchanges once for (``train.backward_passes_per_step``)."""
    ps: PSConfig | None = None
    shard: ShardConfig | None = None
    """The run's ``ps`` section where it trains with servers, and its ``shard`` section."""
    layout: Layout | None = None
    """The job's layout of ranks (None: every one of ``size`` ranks is a data-parallel copy)."""
    places: Sequence[int] | None = None
    """A stage's: each gradient's place among the whole model's, which seeds its draws."""
    process_set: Any = None
    root: int = 0
    """A stage's: Horovod's process set of its copies, and the job rank of its first copy."""


Exchanged = tuple["GradientExchange", Any]
"""What every exchange factory returns: the exchange and the optimizer the step drives with it
(Horovod's wrapper, plain SGD where the exchange applies the update rule, the servers' stand-in,
the sharded optimizer, or the run's own)."""


def build_exchange(cfg: Any, request: ExchangeRequest, stage: bool = False) -> Exchanged:
    """The exchange ``cfg`` trains with, built by the factory the strategies' registry names
    for its framework (:func:`hvdtrain.strategies.table.exchange_path`; ``stage``: a pipeline
    stage's). The one place that resolves it: each framework's ``make_exchange`` and
    ``make_stage_exchange`` call this."""
    module, _, name = exchange_path(cfg, stage).partition(":")
    factory: Callable[[ExchangeRequest], Exchanged] = getattr(import_module(module), name)
    return factory(request)


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

    def run_length(self, total_steps: int) -> None:
        """The run ends at step ``total_steps`` (the same on every rank), told before its first
        step and again after an elastic resize; the compressing exchange resolves its dense start
        (``comm.dense_fraction``) from it. No-op here."""

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
