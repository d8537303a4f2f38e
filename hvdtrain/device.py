"""Where a rank computes: the device policy both engines follow, framework-free.

One rank per GPU: a rank that may use a GPU takes the one at its local rank among those visible,
or the only one visible when its launcher already pinned it (the Slurm template sets
``CUDA_VISIBLE_DEVICES`` to one GPU per rank). The engines ask their framework how many GPUs are
visible and hand the count here, before Horovod starts, so a wrong request fails before anything
runs.
"""

from __future__ import annotations

from hvdtrain.choices import DEVICES
from hvdtrain.errors import HvdtrainError


def choose_device(requested: str, visible_gpus: int) -> str:
    """``cpu`` or ``cuda`` for ``train.device=requested`` on a host where ``visible_gpus`` GPUs are
    visible; ``cuda`` where none is visible is the user's mistake, reported in one line."""
    if requested not in DEVICES:
        raise HvdtrainError(f"train.device={requested!r}: must be one of {', '.join(DEVICES)}")
    if requested == "cpu":
        return "cpu"
    if visible_gpus > 0:
        return "cuda"
    if requested == "cuda":
        raise HvdtrainError("train.device='cuda': no GPU is visible to this process "
                            "(CUDA_VISIBLE_DEVICES, driver, or a framework built without CUDA); "
                            "use train.device=auto or cpu, or run `hvdtrain doctor`")
    return "cpu"


def gpu_index(local_rank: int, local_size: int, visible_gpus: int) -> int:
    """The visible GPU this rank uses: the only one when a single GPU is visible (the launcher gave
    each rank its own), else the one at its local rank. More ranks on a host than GPUs is refused:
    NCCL cannot run two ranks on one GPU."""
    if visible_gpus == 1:
        return 0
    if not 0 <= local_rank < visible_gpus:
        raise HvdtrainError(f"{local_size} ranks on this host but {visible_gpus} GPUs visible: "
                            "hvdtrain runs one rank per GPU; start at most as many ranks per host "
                            "as GPUs")
    return local_rank


def describe(device: str, index: int | None, nccl_built: bool, controller: str) -> dict[str, str]:
    """The summary's ``device`` and ``collectives`` entries: where this rank computed, and what
    carried its gradients (NCCL for GPU tensors when Horovod was built with it; else the
    controller, Gloo or MPI, on host memory)."""
    where = f"cuda:{index}" if device == "cuda" else "cpu"
    if device == "cuda" and nccl_built:
        return {"device": where, "collectives": "nccl"}
    return {"device": where, "collectives": controller}
