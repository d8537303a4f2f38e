"""What a strategy is in the core: its name, when a config runs it, its row of the one
compatibility table (:mod:`hvdtrain.strategies.table`), the engine and the exchanges it builds in
each framework, its checkpoint layout and its cost for ``hvdtrain plan``.

Framework-free and feature-free: a rule is data plus small predicates over the config's
dataclasses, so that :mod:`hvdtrain.config` can validate with the table and stay a leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Predicate = Callable[[Any], bool]
Message = Callable[[Any], str]

def always(cfg: Any) -> bool:
    """A predicate that holds for every config (the last kind of a strategy's exchanges)."""
    return True


DENSE = ("none", "fp16")
"""Compression methods whose exchange is a dense allreduce of the whole gradient."""

SPARSE = ("topk", "randomk", "qsgd")
"""Compression methods that send a sparse or quantized gradient."""


@dataclass(frozen=True)
class Rule:
    """One refused cell of the compatibility table: strategy ``row`` with the setting ``column``.

    ``applies`` says whether a config has both; ``message`` is the one-line error both the run
    (:class:`hvdtrain.errors.ConfigError`) and ``hvdtrain plan`` give; ``example`` is a config (as
    dotted overrides of the defaults) that the rule refuses, which the generated page
    docs/compatibility.md and the tests read."""

    row: str
    column: str
    applies: Predicate
    message: Message
    example: Mapping[str, Any]
    only: str = ""
    """When the refusal holds for part of the column only, which part (``under ssp or asp``):
    the page says so beside the number of the reason."""


@dataclass(frozen=True)
class ExchangeKind:
    """One kind of gradient exchange a strategy builds, and where each framework builds it."""

    name: str
    """The kind's name (:func:`hvdtrain.exchange.exchange_kind`): ``dense``, ``compressing``..."""
    applies: Predicate
    """Whether a config of the strategy gets this kind (the strategy's first that applies)."""
    factories: Mapping[str, str]
    """role -> ``"package.module:function"``, a :class:`hvdtrain.frameworks.ExchangeFactory`
    imported only when it is called. The role is the framework (``torch``, ``tensorflow``) for
    the whole model's exchange, ``<framework>.stage`` for a pipeline stage's among its copies. A
    role that is missing is one the compatibility table refuses (a unit test checks)."""


@dataclass(frozen=True)
class CheckpointLayout:
    """How a strategy's training state lies in a checkpoint (:mod:`hvdtrain.checkpoint`), as
    data that the generated page docs/compatibility.md prints and the tests check."""

    files: str
    """``whole``: one ``step-N.ckpt`` with the whole model's state; ``stage parts``: one
    ``step-N.stage-S.part`` per pipeline stage beside a ``step-N.ckpt`` without the model."""
    writer: str
    """Who writes: ``rank 0`` or ``each stage's first copy``."""
    gathered: str
    """What the writer collects first from the other ranks (a collective), or ``nothing``."""
    resumes_at_any_size: bool
    """Whether a checkpoint written at one number of ranks (or stages) resumes at another."""


WHOLE = "whole"
STAGE_PARTS = "stage parts"


@dataclass(frozen=True)
class Strategy:
    """One way of spreading a training over ranks."""

    name: str
    summary: str
    """One line for the compatibility page."""
    active: Predicate
    """Whether a (validated) config runs this strategy."""
    rules: tuple[Rule, ...] = ()
    """This strategy's refused cells, in the order the config checks them."""
    engines: Mapping[str, str] = field(default_factory=dict)
    """framework -> ``"package.module:Class"`` of the engine this strategy trains with, imported
    only when it is made (:func:`hvdtrain.engine.make_engine`); none: the ring's engine, whose
    exchange the strategy picks."""
    exchanges: tuple[ExchangeKind, ...] = ()
    """The gradient exchanges this strategy builds, the first that applies to a config; none:
    the strategy owns no exchange (pipeline stages run the ring's within each stage's copies)."""
    checkpoint: CheckpointLayout | None = None
    """How its state lies in a checkpoint; none: as the strategy it runs with (the ring's)."""
    cost: str = ""
    """``"hvdtrain.plan.module:function"`` pricing this strategy for ``hvdtrain plan``
    (:func:`hvdtrain.plan.predict.plan` calls each strategy's, in the registry's order)."""
    alternatives: Mapping[str, str] = field(default_factory=dict)
    """Columns that are another value of the same key (``ring`` and ``ps`` are both
    ``comm.topology``): the cell says so instead of composing or refusing."""
