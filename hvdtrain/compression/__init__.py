"""Gradient compression, framework-free: the registry of methods (:data:`PLANS`), a plan per method
(:mod:`~hvdtrain.compression.plans`: tensors, rounds of collectives, state, byte counts), its state
and re-sharding (:mod:`~hvdtrain.compression.state`), the exchange that runs a plan
(:mod:`~hvdtrain.compression.exchange`) and the NumPy spec the framework kernels are tested against
(:mod:`~hvdtrain.compression.reference`). The method names and which ``comm`` settings take effect
together are the comm section's, in :mod:`hvdtrain.strategies.comm` (:data:`METHODS`,
:func:`~hvdtrain.strategies.comm.check_comm`), so that the config checks them without importing
this package.

This module imports neither a framework nor :mod:`hvdtrain.config`; plans load when
:func:`make_plan` first needs one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hvdtrain.registry import Registry
from hvdtrain.strategies.comm import METHODS

if TYPE_CHECKING:
    from hvdtrain.compression.plans import CommSettings, Plan

_ENTRIES = {
    "none": "hvdtrain.compression.plans:Plan",
    "fp16": "hvdtrain.compression.plans:Half",
    "topk": "hvdtrain.compression.plans:TopK",
    "randomk": "hvdtrain.compression.plans:RandomK",
    "qsgd": "hvdtrain.compression.plans:QSGD",
    "powersgd": "hvdtrain.compression.plans:PowerSGD",
}

__all__ = ["METHODS", "PLANS", "make_plan"]

PLANS = Registry("compression method", _ENTRIES)
"""Method name -> its :class:`~hvdtrain.compression.plans.Plan` class."""


def make_plan(comm: CommSettings, seed: int, shapes: Sequence[Sequence[int]],
              places: Sequence[int] | None = None, out_last: bool = False) -> Plan:
    """The plan of ``comm.compression`` for gradients of these shapes (the model's order).

    ``seed`` is the run's seed, never ``seed + rank``: draws that ranks share must agree.
    ``places``: each tensor's place among the whole model's, where the plan covers part of it
    (a pipeline stage's), so that its random draws are the whole model's. ``out_last``: the
    framework keeps a layer's outputs in a weight's last dimension (Keras; see
    :func:`~hvdtrain.compression.reference.matrix_shape`).
    """
    return PLANS.get(comm.compression)(comm, seed, shapes, places, out_last)
