"""What the own-loop APIs of both frameworks share without a framework (docs/own-loop.md):
:class:`hvdtrain.torch.api.Trainer` and :class:`hvdtrain.tensorflow.tape.TapeTrainer`."""

from __future__ import annotations

from hvdtrain.errors import HvdtrainError

STEP_KEY = "hvdtrain.step"
"""The key under which :func:`check_same_step`'s step rides along in an API's metric allreduce."""


def check_same_step(total: float, step: int, size: int, where: str) -> None:
    """``total`` is the sum of every rank's step at a collective of the API: unequal steps mean
    the ranks called the loop's collectives in a different order; one line, not a hang later."""
    if total != step * size:
        raise HvdtrainError(f"trainer.{where}() at step {step} on this rank, but the ranks' "
                            f"steps add up to {total:g}: every rank must run the same steps and "
                            f"call {where}() at the same ones")
