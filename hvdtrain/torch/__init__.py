"""The PyTorch side of hvdtrain: everything here may import torch and horovod.torch."""

from hvdtrain.torch.models import MLP, ClassifierAdapter

__all__ = ["MLP", "ClassifierAdapter"]
