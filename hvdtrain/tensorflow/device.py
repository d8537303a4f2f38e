"""Where a TensorFlow rank computes: only its own GPU visible, with memory growth, or the CPU
(policy in :mod:`hvdtrain.device`). Must run before TensorFlow's runtime starts, as the engine's
thread settings do."""

from __future__ import annotations

import warnings

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdtrain.device import choose_device, describe, gpu_index


def visible_gpus() -> int:
    """GPUs TensorFlow sees (``CUDA_VISIBLE_DEVICES`` applied); listing them starts no runtime."""
    return len(tf.config.list_physical_devices("GPU"))


def resolve(requested: str) -> str:
    """``cpu`` or ``cuda`` for ``train.device``, before Horovod starts."""
    return choose_device(requested, visible_gpus())


def place(kind: str, local_rank: int, local_size: int) -> int | None:
    """Makes this rank's GPU the only one TensorFlow uses, growing its memory on demand (so that
    the process does not take the whole GPU up front); on the CPU, hides the GPUs. Returns the
    GPU's index among the visible ones (None on the CPU)."""
    gpus = tf.config.list_physical_devices("GPU")
    index = gpu_index(local_rank, local_size, len(gpus)) if kind == "cuda" else None
    try:
        tf.config.set_visible_devices([gpus[index]] if index is not None else [], "GPU")
        if index is not None:
            tf.config.experimental.set_memory_growth(gpus[index], True)
    except RuntimeError:  # a runtime already started (a second run in a process) keeps its devices
        warnings.warn("TensorFlow's devices are fixed once its runtime started; train.device "
                      "applies to a new process only", stacklevel=2)
    return index


def summary(kind: str, index: int | None) -> dict[str, str]:
    """The run summary's ``device`` and ``collectives``."""
    controller = "mpi" if hvd.mpi_enabled() else "gloo"
    return describe(kind, index, kind == "cuda" and hvd.nccl_built(), controller)
