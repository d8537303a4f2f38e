"""The values of the ``train`` keys that choose a feature: ``train.device``
(:mod:`hvdtrain.device`) and ``train.precision`` (:mod:`hvdtrain.precision`).

The one place these names live, so that :mod:`hvdtrain.config` validates the keys without
importing the features (which import the lists from here). The other sections' names live with
their checks: ``comm.compression`` in :mod:`hvdtrain.strategies.comm`, ``pipeline.schedule`` in
:mod:`hvdtrain.strategies.schedules`. Imports nothing.
"""

from __future__ import annotations

DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
"""``train.device``: ``auto`` (a GPU when one is visible), ``cpu`` or ``cuda``."""

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""``train.precision``."""
