"""The one compatibility table of the strategies, and the registry they are looked up in.

Each strategy module (:mod:`~hvdtrain.strategies.ring`, :mod:`~hvdtrain.strategies.ps`,
:mod:`~hvdtrain.strategies.pipeline`, :mod:`~hvdtrain.strategies.shard`) owns its row: the
settings it does not compose with and the one-line reason. The config refuses with
:func:`check` and ``hvdtrain plan`` says "not applicable" with :func:`refusal`, so the two give
the same reason for every setting they refuse. docs/compatibility.md prints the table
(``python -m hvdtrain.strategies``, :mod:`hvdtrain.strategies.page`).

This module imports no feature package, no framework and not the config (it is typed
``Any`` where it takes one): :mod:`hvdtrain.config` calls it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from hvdtrain.errors import ConfigError
from hvdtrain.registry import Registry
from hvdtrain.strategies import pipeline, ps, ring, shard
from hvdtrain.strategies.base import ExchangeKind, Rule, Strategy

STRATEGIES = Registry("strategy")
"""Name -> :class:`Strategy`; a duplicate is refused, a miss lists the known names."""
for _module in (ring, ps, pipeline, shard):
    STRATEGIES.register(_module.STRATEGY.name, _module.STRATEGY)

COLUMNS: dict[str, str] = {
    "ring": "`comm.topology=ring`",
    "ps": "`comm.topology=ps`",
    "pipeline": "`pipeline.stages` > 1",
    "shard": "`shard.stage=1`",
    "elastic": "`elastic.enabled=true`",
    "accumulation": "`train.backward_passes_per_step` > 1",
    "fp16": "`train.precision=fp16`",
    "bf16": "`train.precision=bf16`",
    "sync_batchnorm": "`model.sync_batchnorm=true`",
    "sparse compression": "`comm.compression` topk, randomk or qsgd",
    "powersgd": "`comm.compression=powersgd`",
    "tensorflow": "`framework=tensorflow`",
}
"""The table's columns: the strategies, then the settings some strategy refuses."""

RULES: tuple[Rule, ...] = (*pipeline.RULES, *ps.RULES, *shard.RULES, *ps.ASYNC_RULES)
"""Every refused cell, in the order a config is checked (the first that applies is reported)."""


def strategy(name: str) -> Strategy:
    """The registered strategy ``name`` (a miss lists the known names)."""
    found: Strategy = STRATEGIES.get(name)
    return found


def active(cfg: Any) -> list[str]:
    """The names of the strategies ``cfg`` runs."""
    return [name for name in STRATEGIES if strategy(name).active(cfg)]


ENGINE_ORDER = ("pipeline", "shard", "ps", "ring")
"""Which active strategy's engine a run trains with, the first that has one for the framework
(the table refuses the combinations where two would: TensorFlow's pipeline stages with
shard.stage; PyTorch's shard within each stage, by the stage's exchange)."""


def engine_path(cfg: Any) -> str:
    """``"package.module:Class"`` of the engine ``cfg`` trains with: a look-up in the registry."""
    for name in ENGINE_ORDER:
        found = strategy(name)
        if found.active(cfg) and cfg.framework in found.engines:
            return found.engines[cfg.framework]
    return strategy("ring").engines[cfg.framework]


EXCHANGE_ORDER = ("shard", "ps", "ring")
"""Whose exchange a run's gradients go through: the first active strategy here (one always is:
``comm.topology`` is ``ring`` or ``ps``). Pipeline stages own none: each stage runs its
exchange's ``<framework>.stage`` role among its copies."""


def exchange_of(cfg: Any) -> ExchangeKind:
    """The kind of exchange ``cfg`` trains with: a look-up in the registry."""
    owner = next(strategy(n) for n in EXCHANGE_ORDER if strategy(n).active(cfg))
    return next(kind for kind in owner.exchanges if kind.applies(cfg))


def exchange_path(cfg: Any, stage: bool = False) -> str:
    """``"package.module:function"`` of the exchange factory ``cfg`` trains with in its
    framework (``stage``: a pipeline stage's, among the stage's copies). Where the framework
    has none, the compatibility table's one-line reason (:class:`ConfigError`)."""
    kind = exchange_of(cfg)
    role = f"{cfg.framework}.stage" if stage else cfg.framework
    path = kind.factories.get(role)
    if path is None:
        raise ConfigError(refusal(cfg) or f"the {kind.name} exchange has no {role} factory and "
                          "the compatibility table refuses nothing: add the rule")
    return path


def refusal(cfg: Any) -> str | None:
    """The one-line reason ``cfg`` cannot run (the first rule that applies), or None."""
    for rule in RULES:
        if strategy(rule.row).active(cfg) and rule.applies(cfg):
            return rule.message(cfg)
    return None


def check(cfg: Any) -> None:
    """Raises :class:`ConfigError` with :func:`refusal`'s reason when ``cfg`` cannot run."""
    reason = refusal(cfg)
    if reason is not None:
        raise ConfigError(reason)


def with_settings(cfg: Any, settings: Mapping[str, Any]) -> Any:
    """A copy of ``cfg`` with dotted ``settings`` (``pipeline.stages: 2``) set and not validated,
    for asking :func:`refusal` about a setting the planner prices (``cfg`` is left as it is)."""
    out = copy.copy(cfg)
    copied: set[str] = set()
    for dotted, value in settings.items():
        section, _, key = dotted.rpartition(".")
        if not section:
            setattr(out, key, value)
            continue
        if section not in copied:
            setattr(out, section, copy.copy(getattr(out, section)))
            copied.add(section)
        setattr(getattr(out, section), key, value)
    return out
