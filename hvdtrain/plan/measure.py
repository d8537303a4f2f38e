"""What both frameworks' ``hvdtrain plan profile`` share: each compression method's ratio (its
plan's byte counts) and the time of its compression kernels, through the framework's
:class:`~hvdtrain.compression.kernels.Kernels`, and the medians of timed repetitions.

The kernels run eagerly on the profiling machine's CPU (or GPU, where the framework returns
when the work is done); a step's kernel time is the sum over the tensors the method compresses.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hvdtrain.compression import METHODS, make_plan
from hvdtrain.compression import reference as ref
from hvdtrain.compression.kernels import Kernels, Tensor
from hvdtrain.compression.plans import CommSettings
from hvdtrain.plan.profile import RATIO_KEYS, MethodProfile


def medians(rows: Sequence[Sequence[float]]) -> list[float]:
    """The median of each column of ``rows`` (one row per timed repetition)."""
    return [statistics.median(col) for col in zip(*rows, strict=True)]


def _kernel(method: str, comm: CommSettings, seed: int, index: int, grad: Tensor,
            shape: tuple[int, ...], k: Kernels, tensor: Callable[[np.ndarray], Tensor]
            ) -> Callable[[], Any]:
    """Stage 0 of ``method`` on one flat gradient (the part a rank computes alone), to time."""
    n = int(np.prod(shape))
    keep = ref.num_selected(n, comm.ratio)
    if method == "fp16":
        return lambda: k.cast(grad, "float16")
    if method == "topk":
        return lambda: k.topk_compress(grad, keep)
    if method == "randomk":
        idx = tensor(ref.randomk_indices(n, keep, seed, 0, index))
        return lambda: k.randomk_compress(grad, idx, 1.0)
    if method == "qsgd":
        noise = k.uniform(tensor(np.array(ref.noise_seed(seed, 0, 0, index), np.int64)), n)
        return lambda: k.qsgd_compress(grad, comm.bucket, noise)
    m = k.reshape(grad, ref.matrix_shape(shape, k.out_last))
    q = tensor(ref.powersgd_initial_q(shape, comm.rank, seed, index, k.out_last))
    return lambda: k.matmul(k.transpose(m), k.orthogonalize(k.matmul(m, q)))


def method_profiles(comm: Any, seed: int, shapes: Sequence[tuple[int, ...]],
                    grads: Sequence[Tensor], kernels: Kernels,
                    tensor: Callable[[np.ndarray], Tensor], repeats: int) -> dict[str, MethodProfile]:
    """Every method's ratio, kernel seconds per step and collective, for gradients ``grads`` (flat
    framework tensors, model order) of ``shapes``; ``comm`` is the run's ``comm`` section."""
    out = {}
    for method in METHODS:
        plan = make_plan(dataclasses.replace(comm, compression=method), seed, shapes,
                         out_last=kernels.out_last)
        seconds = 0.0
        for t, grad in zip(plan.tensors, grads, strict=True):
            if method != "none" and (t.compressed or method == "fp16"):
                run = _kernel(method, plan.comm, seed, t.index, grad, t.shape, kernels, tensor)
                run()  # the first call may trace or allocate
                start = time.perf_counter()
                for _ in range(repeats):
                    run()
                seconds += (time.perf_counter() - start) / repeats
        out[method] = MethodProfile(plan.dense_bytes() / max(1, plan.wire_bytes()), seconds,
                                    plan.collective, {k: float(getattr(comm, k))
                                                      for k in RATIO_KEYS})
    return out
