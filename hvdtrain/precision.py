"""Mixed precision policy both engines follow, framework-free.

``fp32`` computes in float32. ``bf16`` computes eligible operations in bfloat16 (PyTorch's
``autocast``, Keras's ``mixed_bfloat16`` policy) while weights, optimizer state and gradient
exchange stay float32; bfloat16 has float32's range, so it needs no loss scaling and runs on CPU
too. ``fp16`` does the same in float16, whose range is small: the loss is scaled up before the
backward pass and the gradients unscaled before the update (PyTorch's ``GradScaler``, Keras's
``LossScaleOptimizer``); a step whose gradients overflowed is skipped and the scale lowered. The
names (``train.precision``) are :data:`hvdtrain.choices.PRECISIONS`.
"""

from __future__ import annotations

MAX_SKIPPED_IN_ROW = 30
"""fp16: consecutive steps the loss scaler may skip before the run counts as diverged. Each skip
halves the scale (2**16 at the start), so thirty in a row leave it far below one: what overflows
then is the model itself, not the scaling."""


def scales_loss(precision: str) -> bool:
    """Whether ``precision`` needs loss scaling (float16's range is too small for gradients)."""
    return precision == "fp16"


class SkippedSteps:
    """Tells a step the loss scaler skipped (an overflow, not a divergence) from a diverged run."""

    def __init__(self, limit: int = MAX_SKIPPED_IN_ROW) -> None:
        self.limit = limit
        self.in_row = 0
        self.total = 0

    def tolerated(self, skipped: bool) -> bool:
        """Records one step; True when it was skipped and the run may go on (its non-finite loss is
        no divergence), False when it was not skipped or too many were skipped in a row."""
        if not skipped:
            self.in_row = 0
            return False
        self.in_row += 1
        self.total += 1
        return self.in_row <= self.limit
