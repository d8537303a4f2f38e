"""The ``ps`` gradient exchange for PyTorch (:mod:`hvdtrain.ps.exchange`): tensors to one flat
NumPy vector and back; the optimizer stays the run's own (no ``DistributedOptimizer``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hvdtrain.ps.exchange import PSExchange
from hvdtrain.torch.collectives import any_rank


class TorchPSExchange(PSExchange):
    """:class:`hvdtrain.ps.exchange.PSExchange` over torch gradients (CPU or GPU)."""

    device = torch.device("cpu")

    def flatten(self, grads: Sequence[torch.Tensor]) -> np.ndarray:
        self.device = grads[0].device if grads else self.device
        flat = torch.cat([g.detach().reshape(-1).to("cpu", torch.float32) for g in grads])
        return flat.numpy()

    def unflatten(self, flat: np.ndarray) -> list[torch.Tensor]:
        return [torch.from_numpy(part).to(self.device) for part in self.split(flat)]

    def any_rank(self, flag: bool) -> bool:
        return any_rank(flag)
