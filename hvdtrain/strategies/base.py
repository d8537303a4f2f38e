"""What a strategy is in the core: its name, when a config runs it, and its row of the one
compatibility table (:mod:`hvdtrain.strategies.table`).

Framework-free and feature-free: a rule is data plus small predicates over the config's
dataclasses, so that :mod:`hvdtrain.config` can validate with the table and stay a leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Predicate = Callable[[Any], bool]
Message = Callable[[Any], str]

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
    alternatives: Mapping[str, str] = field(default_factory=dict)
    """Columns that are another value of the same key (``ring`` and ``ps`` are both
    ``comm.topology``): the cell says so instead of composing or refusing."""
