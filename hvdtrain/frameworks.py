"""What each framework package provides: one protocol per role, checked by mypy.

``hvdtrain/torch`` and ``hvdtrain/tensorflow`` each fulfil every protocol here; their
``contract.py`` assigns the package's modules and classes to these types, so that mypy
(``make lint``) fails when a package's name or signature drifts from the other's. What a
framework cannot do is not a missing name: the strategies' registry names no factory for it, and
the compatibility table refuses it with one line (:func:`hvdtrain.strategies.table.exchange_path`).

Framework-free: imports neither torch nor tensorflow.
"""

from __future__ import annotations

from typing import Any, Protocol

from hvdtrain.config import Config
from hvdtrain.data.contracts import Dataset
from hvdtrain.engine import Collectives, Engine
from hvdtrain.exchange import Exchanged, ExchangeRequest
from hvdtrain.plan.profile import ModelProfile


class EngineClass(Protocol):
    """The engine role: a class the strategies' registry names in ``engines``
    (:func:`hvdtrain.engine.make_engine`), made from the config and the dataset."""

    def __call__(self, cfg: Config, dataset: Dataset) -> Engine: ...


class ExchangeFactory(Protocol):
    """One kind of exchange, as the registry's ``exchanges`` name it
    (:attr:`hvdtrain.strategies.base.ExchangeKind.factories`): the exchange and the optimizer
    the step drives with it."""

    def __call__(self, request: ExchangeRequest, /) -> Exchanged: ...


class ExchangeParts(Protocol):
    """The exchange role (``<framework>/exchange.py``): the look-up and a factory per kind the
    ring and the parameter servers build in both frameworks."""

    def make_exchange(self, cfg: Any, request: ExchangeRequest) -> Exchanged:
        """The run's exchange, by :func:`hvdtrain.exchange.build_exchange`."""

    def dense_exchange(self, request: ExchangeRequest) -> Exchanged:
        """``dense``: Horovod's allreduce of every gradient."""

    def compressing_exchange(self, request: ExchangeRequest) -> Exchanged:
        """``compressing``: a method's plan with the framework's kernels."""

    def ps_exchange(self, request: ExchangeRequest) -> Exchanged:
        """``ps`` (``bsp``): push to and pull from the parameter servers."""


class StageParts(Protocol):
    """The stage role (``torch/stages.py``, ``tensorflow/pipeline.py``): a pipeline stage's
    exchange among the stage's copies, looked up as the whole model's is."""

    def make_stage_exchange(self, cfg: Any, request: ExchangeRequest) -> Exchanged:
        """The stage's exchange, by :func:`hvdtrain.exchange.build_exchange` (``stage=True``)."""


class Kernels(Protocol):
    """The kernels role (``<framework>/collectives.py``): the one question every exchange asks
    of all ranks; the collectives class is checked as :data:`CollectivesClass`."""

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (a collective)."""


class CollectivesClass(Protocol):
    """The collectives an engine hands the loop (:class:`hvdtrain.engine.Collectives`)."""

    def __call__(self) -> Collectives: ...


class Profiler(Protocol):
    """The profiler role (``<framework>/plan_profile.py``): measures a model for ``hvdtrain
    plan``."""

    def profile_model(self, cfg: Config, steps: int) -> ModelProfile:
        """The model's profile from ``steps`` timed steps on this machine."""
