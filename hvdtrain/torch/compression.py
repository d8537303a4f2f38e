"""Gradient compression for PyTorch: the kernels of :mod:`hvdtrain.compression.reference` in torch,
and the exchange that runs them with asynchronous Horovod collectives after backward.

``none`` and ``fp16`` keep Horovod's DistributedOptimizer (allreduce overlapped with backward) with a
:class:`CountingCompression` that records the bytes it hands to Horovod. ``topk``, ``randomk``,
``qsgd`` and ``powersgd`` run :class:`GradientExchange` once per optimizer step, after all
micro-batches' gradients have accumulated locally.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import horovod.torch as hvd
import torch

from hvdtrain.compression import reference as ref
from hvdtrain.config import CommConfig
from hvdtrain.errors import HvdtrainError

_HOROVOD = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


class CountingCompression:
    """A Horovod compressor that delegates to ``base`` and counts the bytes of what it compressed."""

    def __init__(self, base: Any) -> None:
        self.base = base
        self.wire_bytes = 0
        self.dense_bytes = 0

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Compresses as ``base`` does; the result is exactly what Horovod allreduces."""
        out, ctx = self.base.compress(tensor)
        self.wire_bytes += out.numel() * out.element_size()
        self.dense_bytes += tensor.numel() * tensor.element_size()
        return out, ctx

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Undoes :meth:`compress`."""
        return self.base.decompress(tensor, ctx)

    def take(self) -> tuple[int, int]:
        """The (wire, dense) bytes counted since the last call, and a fresh count."""
        counts = self.wire_bytes, self.dense_bytes
        self.wire_bytes = self.dense_bytes = 0
        return counts


def horovod_compression(name: str) -> CountingCompression:
    """A counting Horovod compressor for ``none`` or ``fp16``."""
    if name not in _HOROVOD:
        raise HvdtrainError(f"comm.compression={name!r}: Horovod's own compressors are "
                            f"{', '.join(_HOROVOD)}")
    return CountingCompression(_HOROVOD[name])


# kernels: each mirrors the reference function of the same name ----------------------------------

def topk_compress(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest-magnitude entries of flat ``x``: values and int32 indices, ascending."""
    _, idx = torch.topk(x.abs(), k, sorted=False)
    idx = torch.sort(idx).values
    return x[idx], idx.to(torch.int32)


def scatter(values: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    """A dense float32 vector of ``n`` with ``values`` added at ``indices``."""
    out = torch.zeros(n, dtype=torch.float32)
    return out.index_add_(0, indices.long(), values)


def qsgd_compress(x: torch.Tensor, bucket: int, noise: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and float32 per-bucket scales of flat ``x``; ``noise`` is U[0, 1), shape of ``x``."""
    rows = _bucketed(x, bucket)
    scales = rows.abs().amax(dim=1)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))[:, None]
    level = torch.floor(rows.abs() / safe * float(ref.QSGD_LEVELS) + _bucketed(noise, bucket))
    level = level.clamp_(max=float(ref.QSGD_LEVELS))  # 127 + u may round to 128: see the reference
    codes = (torch.sign(rows) * level).reshape(-1)[:x.numel()].to(torch.int8)
    return codes, scales


def qsgd_decompress(codes: torch.Tensor, scales: torch.Tensor, bucket: int) -> torch.Tensor:
    """The float32 vector that ``codes`` and ``scales`` stand for."""
    rows = _bucketed(codes.to(torch.float32), bucket)
    return (rows * (scales / float(ref.QSGD_LEVELS))[:, None]).reshape(-1)[:codes.numel()]


def _bucketed(flat: torch.Tensor, bucket: int) -> torch.Tensor:
    n = flat.numel()
    width = n if bucket <= 0 else bucket
    rows = ref.qsgd_buckets(n, bucket)
    padded = torch.zeros(rows * width, dtype=torch.float32)
    padded[:n] = flat
    return padded.reshape(rows, width)


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns of ``p``, as the reference defines it."""
    p = p.clone()
    for i in range(p.shape[1]):
        col = p[:, i]
        col /= torch.sqrt(torch.sum(col * col)) + ref.GRAM_SCHMIDT_EPS
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest -= torch.outer(col, col @ rest)
    return p


# the exchange -----------------------------------------------------------------------------------

class _Timer:
    """Sums the seconds spent waiting in ``hvd.synchronize``."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wait(self, handle: Any) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return hvd.synchronize(handle)
        finally:
            self.seconds += time.perf_counter() - start


class GradientExchange:
    """Averages gradients over ranks with one compression method; see the reference for the math.

    ``run(grads)`` replaces each gradient in place by the (approximate) average over ranks. State
    (error-feedback residuals, PowerSGD's Q, the step counter that seeds random-k) is in
    :meth:`state_dict` and is restored exactly by :meth:`load_state_dict`.
    """

    def __init__(self, comm: CommConfig, seed: int, shapes: Sequence[torch.Size]) -> None:
        self.comm, self.seed, self.method = comm, seed, comm.compression
        self.shapes = [tuple(s) for s in shapes]
        self.compressed = [ref.compressible(self.method, s, comm.min_size, comm.rank)
                           for s in self.shapes]
        self.step = 0
        self.residuals: dict[int, torch.Tensor] = {}
        self.q: dict[int, torch.Tensor] = {
            i: torch.from_numpy(ref.powersgd_initial_q(s, comm.rank, seed, i))
            for i, s in enumerate(self.shapes) if self.method == "powersgd" and self.compressed[i]}
        # QSGD's rounding noise: a stream per rank (independent noise keeps the average unbiased
        # with less variance), seeded with seed * 7919 + rank; its state is checkpointed.
        self.noise = torch.Generator().manual_seed(seed * 7919 + hvd.rank())
        self.stats = {"wire_bytes": 0.0, "dense_bytes": 0.0, "comm_s": 0.0, "compress_s": 0.0}
        self.compress_s_total = 0.0
        """Seconds in compression kernels (the exchange less its waits), all steps: for benchmarks."""

    def run(self, grads: list[torch.Tensor]) -> None:
        """Averages ``grads`` (one per shape, in order) over all ranks, in place."""
        self.step += 1
        timer, start = _Timer(), time.perf_counter()
        wire = 0
        finish: list[Callable[[_Timer], Any]] = []
        for i, grad in enumerate(grads):
            method = self.method if self.compressed[i] else "dense"
            sent, done = getattr(self, f"_start_{method}")(i, grad)
            wire += sum(t.numel() * t.element_size() for t in sent)
            finish.append(done)
        later = [f(timer) for f in finish]  # PowerSGD returns a second phase (the Q allreduce)
        for f in later:
            if f is not None:
                wire += f(timer)
        dense = sum(g.numel() * g.element_size() for g in grads)
        self.stats = {"wire_bytes": float(wire), "dense_bytes": float(dense), "comm_s": timer.seconds,
                      "compress_s": time.perf_counter() - start - timer.seconds}
        self.compress_s_total += self.stats["compress_s"]

    # each _start_* launches its collectives and returns (tensors sent, finish(timer))

    def _start_dense(self, i: int, grad: torch.Tensor) -> tuple[list[torch.Tensor], Callable]:
        flat = grad.reshape(-1).contiguous()
        handle = hvd.allreduce_async(flat, op=hvd.Average, name=f"hvdtrain.dense.{i}")

        def done(timer: _Timer) -> None:
            grad.copy_(timer.wait(handle).view_as(grad))
        return [flat], done

    def _accumulate(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        acc = grad.reshape(-1).clone()
        if self.comm.error_feedback and i in self.residuals:
            acc += self.residuals[i]
        return acc

    def _keep_residual(self, i: int, acc: torch.Tensor, sent: torch.Tensor) -> None:
        if self.comm.error_feedback:
            self.residuals[i] = acc - sent

    def _start_topk(self, i: int, grad: torch.Tensor) -> tuple[list[torch.Tensor], Callable]:
        acc = self._accumulate(i, grad)
        n = acc.numel()
        values, idx = topk_compress(acc, ref.num_selected(n, self.comm.ratio))
        self._keep_residual(i, acc, scatter(values, idx, n))
        hv = hvd.allgather_async(values, name=f"hvdtrain.topk.v.{i}")
        hi = hvd.allgather_async(idx, name=f"hvdtrain.topk.i.{i}")

        def done(timer: _Timer) -> None:
            total = scatter(timer.wait(hv), timer.wait(hi), n)
            grad.copy_((total / hvd.size()).view_as(grad))
        return [values, idx], done

    def _start_randomk(self, i: int, grad: torch.Tensor) -> tuple[list[torch.Tensor], Callable]:
        acc = self._accumulate(i, grad)
        n = acc.numel()
        k = ref.num_selected(n, self.comm.ratio)
        idx = torch.from_numpy(ref.randomk_indices(n, k, self.seed, self.step, i)).long()
        values = acc[idx] * ref.randomk_scale(n, k, self.comm.error_feedback)
        self._keep_residual(i, acc, scatter(values, idx, n))
        handle = hvd.allreduce_async(values, op=hvd.Average, name=f"hvdtrain.randomk.{i}")

        def done(timer: _Timer) -> None:
            grad.copy_(scatter(timer.wait(handle), idx, n).view_as(grad))
        return [values], done

    def _start_qsgd(self, i: int, grad: torch.Tensor) -> tuple[list[torch.Tensor], Callable]:
        flat = grad.reshape(-1)
        noise = torch.rand(flat.numel(), generator=self.noise)
        codes, scales = qsgd_compress(flat, self.comm.bucket, noise)
        hc = hvd.allgather_async(codes, name=f"hvdtrain.qsgd.c.{i}")
        hs = hvd.allgather_async(scales, name=f"hvdtrain.qsgd.s.{i}")

        def done(timer: _Timer) -> None:
            all_codes, all_scales = timer.wait(hc), timer.wait(hs)
            n, b = flat.numel(), scales.numel()
            total = torch.zeros(n)
            for r in range(hvd.size()):  # rank order, like the reference's mean
                total += qsgd_decompress(all_codes[r * n:(r + 1) * n], all_scales[r * b:(r + 1) * b],
                                         self.comm.bucket)
            grad.copy_((total / hvd.size()).view_as(grad))
        return [codes, scales], done

    def _start_powersgd(self, i: int, grad: torch.Tensor) -> tuple[list[torch.Tensor], Callable]:
        rows, cols = ref.matrix_shape(grad.shape)
        m = self._accumulate(i, grad).view(rows, cols)
        p = m @ self.q[i]
        hp = hvd.allreduce_async(p, op=hvd.Average, name=f"hvdtrain.powersgd.p.{i}")

        def done(timer: _Timer) -> Callable[[_Timer], int]:
            ortho = orthogonalize(timer.wait(hp))
            local_q = m.t() @ ortho
            self._keep_residual(i, m.reshape(-1), (ortho @ local_q.t()).reshape(-1))
            hq = hvd.allreduce_async(local_q, op=hvd.Average, name=f"hvdtrain.powersgd.q.{i}")

            def second(timer2: _Timer) -> int:
                self.q[i] = timer2.wait(hq)
                grad.copy_((ortho @ self.q[i].t()).view_as(grad))
                return local_q.numel() * local_q.element_size()
            return second
        return [p], done

    # state ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's compression state, as tensors and numbers (``weights_only`` loadable)."""
        return {"method": self.method, "step": self.step,
                "residuals": {str(i): r.clone() for i, r in self.residuals.items()},
                "q": {str(i): q.clone() for i, q in self.q.items()},
                "noise": self.noise.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output (of the same method and model)."""
        if state["method"] != self.method:
            raise HvdtrainError(f"the checkpoint's compression state is for {state['method']!r}, "
                                f"this run uses comm.compression={self.method!r}")
        self.step = int(state["step"])
        self.residuals = {int(i): r.clone() for i, r in state["residuals"].items()}
        self.q.update({int(i): q.clone() for i, q in state["q"].items()})
        self.noise.set_state(state["noise"])


def state_for_rank(states: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    """This rank's compression state from every rank's, as gathered into a checkpoint.

    At the same world size each rank gets its own. At another size each gets the old ranks' mean
    residual, which keeps the gradient still owed to the average (``sum(residuals) / size``) intact.
    """
    if rank < len(states) and len(states) == hvd.size():
        return states[rank]
    mean = {i: torch.stack([s["residuals"][i] for s in states]).mean(dim=0)
            for i in states[0]["residuals"]}
    return {**states[0], "residuals": mean}
