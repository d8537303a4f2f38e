"""Where a PyTorch rank computes: one GPU per rank by local rank, or the CPU (policy in
:mod:`hvdtrain.device`), and moving batches there."""

from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import torch

from hvdtrain.device import choose_device, describe, gpu_index


def visible_gpus() -> int:
    """GPUs this process may use (``CUDA_VISIBLE_DEVICES`` applied); 0 with a CPU-only torch."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve(requested: str) -> str:
    """``cpu`` or ``cuda`` for ``train.device``; asked before Horovod starts, so that ``cuda``
    without a GPU is an error before anything runs."""
    return choose_device(requested, visible_gpus())


def place(kind: str, local_rank: int, local_size: int) -> torch.device:
    """This rank's device. A GPU is made the current one, so that Horovod's NCCL work, allocations
    and kernels of this process stay on it."""
    if kind != "cuda":
        return torch.device("cpu")
    index = gpu_index(local_rank, local_size, visible_gpus())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def pins_memory(device: torch.device) -> bool:
    """Whether batches bound for ``device`` are staged in pinned (page-locked) host memory: for a
    GPU only, where it lets the copy to the device run without the host waiting for it. Pinning
    needs a CUDA runtime, so a CPU rank must never ask for it."""
    return device.type == "cuda"


def pinned(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in pinned host memory when ``device`` wants it (see :func:`pins_memory`),
    else unchanged."""
    if not pins_memory(device):
        return tensors
    return tuple(t.pin_memory() for t in tensors)


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[Any, ...]:
    """The tensors on ``device``; copies from pinned host memory do not wait for the GPU."""
    if device.type == "cpu":
        return tensors
    return tuple(t.to(device, non_blocking=True) for t in tensors)


def summary(device: torch.device) -> dict[str, str]:
    """The run summary's ``device`` and ``collectives``."""
    controller = "mpi" if hvd.mpi_enabled() else "gloo"
    nccl = device.type == "cuda" and hvd.nccl_built()
    return describe(device.type, device.index, nccl, controller)
