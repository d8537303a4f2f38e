"""Synchronized batch normalization for PyTorch: the batch-norm layers of a model normalize with
the mean and variance of the global batch (all ranks' samples), not of the rank's share.

On a GPU the layers become Horovod's ``SyncBatchNorm``. Horovod's refuses CPU tensors (it uses
CUDA-only kernels), so on the CPU they become :class:`CpuSyncBatchNorm`, the same statistics from
two allreduces (sums and counts, then squared deviations; differentiable, so the backward pass is
synchronized too). Both keep the layers' parameters and buffers, so checkpoints are unchanged.
"""

from __future__ import annotations

import horovod.torch as hvd
import torch
from torch.nn.modules.batchnorm import _BatchNorm


class CpuSyncBatchNorm(_BatchNorm):
    """Batch norm over every rank's samples, for any device (used on the CPU).

    ``sync_name`` names its collectives: Horovod pairs tensors across ranks by name, so it must be
    the same on every rank (:func:`convert` gives the layer's path in the model).
    """

    sync_name = "hvdtrain.syncbn"

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or hvd.size() == 1:
            return super().forward(input)  # one rank's samples are all there are: torch's own
        mean, var, count = self._global_moments(input)
        self._update_running(mean, var, count)
        shape = [1, -1] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    def _global_moments(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        dims = [0, *range(2, input.dim())]
        samples = input.new_tensor([input.numel() / max(input.size(1), 1)])
        local = torch.cat([input.sum(dims), samples])
        total = hvd.allreduce(local, op=hvd.Sum, name=f"{self.sync_name}.sum")
        count = float(total[-1])
        mean = total[:-1] / max(count, 1.0)
        shape = [1, -1] + [1] * (input.dim() - 2)
        squares = ((input - mean.view(shape)) ** 2).sum(dims)
        var = hvd.allreduce(squares, op=hvd.Sum, name=f"{self.sync_name}.var") / max(count, 1.0)
        return mean, var, count

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
        tracked, running_mean, running_var = (self.num_batches_tracked, self.running_mean,
                                              self.running_var)
        if tracked is None or running_mean is None or running_var is None:
            return  # track_running_stats=False: the layer has no such buffers
        tracked.add_(1)
        # As torch's BatchNorm: the running variance is the unbiased one.
        unbiased = var * (count / max(count - 1.0, 1.0))
        momentum = self.momentum if self.momentum is not None else 1.0 / float(tracked)
        running_mean.lerp_(mean.detach(), momentum)
        running_var.lerp_(unbiased.detach(), momentum)


def convert(module: torch.nn.Module, device: torch.device, path: str = "model") -> torch.nn.Module:
    """``module`` with every batch-norm layer replaced by a synchronized one for ``device``
    (parameters, buffers and train/eval mode carried over)."""
    cls = hvd.SyncBatchNorm if device.type == "cuda" else CpuSyncBatchNorm
    synced_already = isinstance(module, (hvd.SyncBatchNorm, CpuSyncBatchNorm))
    if isinstance(module, _BatchNorm) and not synced_already:
        synced = cls(module.num_features, module.eps, module.momentum, module.affine,
                     module.track_running_stats)
        synced.load_state_dict(module.state_dict())
        synced.train(module.training)
        synced.sync_name = f"hvdtrain.syncbn.{path}"
        return synced
    for name, child in module.named_children():
        module.add_module(name, convert(child, device, f"{path}.{name}"))
    return module
