"""The PyTorch side of hvdtrain: everything here may import torch and horovod.torch."""

from typing import Any

from hvdtrain.torch.models import MLP, ClassifierAdapter

__all__ = ["MLP", "ClassifierAdapter", "Trainer", "launch"]


def __getattr__(name: str) -> Any:
    """``Trainer`` and ``launch`` (docs/own-loop.md), imported on first use: they start Horovod's
    module, which the rest of this package does not need at import."""
    if name in ("Trainer", "launch"):
        from hvdtrain.torch import api
        return getattr(api, name)
    raise AttributeError(f"module 'hvdtrain.torch' has no attribute {name!r}")
