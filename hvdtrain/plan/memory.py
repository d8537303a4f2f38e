"""A rank's memory as the planner prices it (docs/planner.md, "Memory per rank"): the model's
state by ZeRO's count in float32 (parameters, gradients, optimizer state, each whole or 1/N by
``shard.stage``), plus hvdtrain's float32 shard at stages 1-2, the activations of one backward
pass, and at stage 3 the units gathered at once. A setting whose figure exceeds the cluster
file's ``memory_gib`` is not applicable at that node count, with the figure as the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hvdtrain.plan.profile import LayerProfile

GIB = 2**30

WEIGHT = 4.0
"""Bytes of a float32 parameter, and of its gradient (the plan prices ``train.precision=fp32``)."""
ADAM_STATE = 8.0
"""Bytes a parameter of Adam's (and AdamW's) two float32 moments: the state without a config."""


def state_bytes(optimizer: str, momentum: float) -> float:
    """The optimizer state's bytes a parameter in float32: Adam and AdamW's two moments (8), SGD's
    momentum buffer (4, none at ``momentum`` 0)."""
    if optimizer in ("adam", "adamw"):
        return ADAM_STATE
    return WEIGHT if momentum > 0 else 0.0


def model_bytes(params: float, ranks: int, stage: int, state: float) -> float:
    """Parameters, gradients and optimizer state a rank holds at ``shard.stage`` over ``ranks``
    data-parallel ranks: ZeRO's count (Rajbhandari et al., SC 2020, Figure 1) in float32, where a
    parameter is 4 bytes, its gradient 4 and its state ``state`` (Adam: 8; 16 in all, as ZeRO's
    mixed-precision Adam): stage 0 ``4 + 4 + s``, stage 1 ``4 + 4 + s/N``, stage 2 ``4 + (4 +
    s)/N``, stage 3 ``(4 + 4 + s)/N``. At stages 1 and 2 each rank also keeps its shard of the
    parameters in float32 for its optimizer to step (docs/sharding.md): ``+ 4/N``; at stage 3
    that shard is the parameters."""
    n = max(1, ranks)
    if stage <= 0:
        per = 2 * WEIGHT + state
    elif stage == 1:
        per = 2 * WEIGHT + (state + WEIGHT) / n
    elif stage == 2:
        per = WEIGHT + (WEIGHT + state + WEIGHT) / n
    else:
        per = (2 * WEIGHT + state) / n
    return params * per


def activation_bytes(layers: Sequence[LayerProfile], scale: float) -> float:
    """The layers' output bytes for ``scale`` of the profiled batch: what one backward pass keeps
    of its forward pass at the layers' boundaries (a lower bound where a layer keeps more inside
    it, as without ``model.activation_checkpointing``)."""
    return scale * sum(x.activation_bytes for x in layers)


@dataclass(frozen=True)
class Memory:
    """A rank's memory at one setting and node count, in bytes by part."""

    model: float
    """Parameters, gradients and optimizer state (:func:`model_bytes`)."""
    activations: float
    gathered: float = 0.0
    """Stage 3: the units' parameters gathered whole at once (and the unit-less parameters)."""

    @property
    def total(self) -> float:
        """The rank's bytes."""
        return self.model + self.activations + self.gathered

    def describe(self) -> str:
        """The figure and its parts in GiB, for a reason."""
        parts = f"model state {self.model / GIB:.2f}, activations {self.activations / GIB:.2f}"
        if self.gathered:
            parts += f", gathered units {self.gathered / GIB:.2f}"
        return f"{self.total / GIB:.2f} GiB a rank ({parts})"


def misfit(memory: Memory | None, limit_gib: float) -> str:
    """Why ``memory`` does not fit a rank of ``limit_gib`` ("" when it does, or when either is
    unknown: no figure, or the cluster file gives no ``memory_gib``)."""
    if memory is None or limit_gib <= 0 or memory.total <= limit_gib * GIB:
        return ""
    return f"needs {memory.describe()}, more than the cluster's memory_gib={limit_gib:g}"
