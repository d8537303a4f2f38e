"""Per compression method, the framework-free plan: which tensors it compresses, what each sends
in which round (allgathered or averaged), its state, its host-side draws and its byte counts.

A plan's stages are written once against :class:`~hvdtrain.compression.kernels.Kernels`; the
framework exchanges (:mod:`hvdtrain.compression.exchange`) run them. Per compressed tensor, stage 0
(:meth:`Plan.start`) turns ``acc`` (the flat gradient, plus the residual under error feedback)
into a :class:`Message`; after each round's collectives, :meth:`Plan.advance` turns what came back
into the next message, and the last round's into the flat average (:attr:`Stage.out`). Tensors a
method does not compress are averaged in round 1 as ``dense_dtype``. The math is
:mod:`hvdtrain.compression.reference`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol

import numpy as np

from hvdtrain.compression import reference as ref
from hvdtrain.compression.kernels import Context, Tensor
from hvdtrain.compression.state import Q_LOW, RESIDUAL, Q, Slot, slot_key


class CommSettings(Protocol):
    """The ``comm`` settings a plan reads (:class:`hvdtrain.config.CommConfig` has them)."""

    compression: str
    ratio: float
    error_feedback: bool
    rank: int
    min_size: int
    bucket: int
    adaptive: bool
    adaptive_factor: int


@dataclass(frozen=True)
class TensorPlan:
    """One gradient tensor as its method sees it."""

    index: int
    shape: tuple[int, ...]
    size: int
    compressed: bool
    draws: int = -1
    """The tensor's place in the whole model, which seeds its random draws (random-k's indices,
    qsgd's noise, PowerSGD's first ``Q``), so that a pipeline stage's tensor draws what the same
    tensor of the whole model draws; -1: ``index``."""

    @property
    def seed_index(self) -> int:
        """The index its random draws are seeded with."""
        return self.index if self.draws < 0 else self.draws


class Message(NamedTuple):
    """What one tensor hands to a round's collectives."""

    gather: tuple = ()
    """Allgathered: every rank receives all ranks' tensors, concatenated in rank order."""
    mean: tuple = ()
    """Averaged over the ranks (allreduce)."""


class Stage(NamedTuple):
    """A plan stage's result for one tensor."""

    send: Message = Message()
    """For the next round (empty after the last)."""
    carry: tuple = ()
    """Tensors the next stage needs."""
    sent: Tensor = None
    """This rank's decompressed contribution, once known: error feedback keeps ``acc - sent``."""
    out: Tensor = None
    """The flat average over the ranks, from the last stage."""
    picked: Tensor = None
    """The indices this rank sent (sparse methods), for DGC's momentum factor masking."""


class Plan:
    """A method that compresses nothing: every tensor is averaged as ``dense_dtype`` (``none``)."""

    dense: ClassVar[bool] = True
    """Every tensor travels dense: Horovod's own compressors do the same (PyTorch uses them)."""
    feedback: ClassVar[bool] = False
    """Whether the method keeps error-feedback residuals (when ``comm.error_feedback`` is on)."""
    rounds: ClassVar[int] = 1
    """Collective rounds per step."""
    dense_dtype: ClassVar[str] = "float32"
    """What uncompressed tensors travel as."""
    collective: ClassVar[str] = "allreduce"
    """The collective its compressed tensors travel by (``allgather`` where the messages of the
    ranks cannot be summed): what ``hvdtrain plan`` prices."""
    ratio: float | None = None
    """The fraction sparse methods send this step, where a density warm-up or the adaptive rule
    sets it (None: ``comm.ratio``)."""
    rank: int | None = None
    """PowerSGD's rank this step, where the adaptive rule raises it (None: ``comm.rank``)."""

    def __init__(self, comm: CommSettings, seed: int, shapes: Sequence[Sequence[int]],
                 places: Sequence[int] | None = None, out_last: bool = False) -> None:
        self.comm, self.seed, self.method = comm, seed, comm.compression
        self.out_last = out_last
        """Whether the framework keeps a layer's outputs in a weight's last dimension
        (:func:`~hvdtrain.compression.reference.matrix_shape`)."""
        self.tensors = []
        for i, shape in enumerate(shapes):
            dims = tuple(int(d) for d in shape)
            self.tensors.append(TensorPlan(i, dims, math.prod(dims), self.compressible(dims),
                                           -1 if places is None else int(places[i])))
        self.uses_feedback = self.feedback and comm.error_feedback

    def compressible(self, shape: tuple[int, ...]) -> bool:
        """Whether this method compresses a tensor of ``shape``."""
        return False

    def slots(self) -> list[Slot]:
        """The method's state: residuals of the compressed tensors under error feedback."""
        return [Slot(RESIDUAL, t.index, np.zeros(t.size, np.float32))
                for t in self.tensors if t.compressed and self.uses_feedback]

    def host(self, t: TensorPlan, step: int, rank: int) -> np.ndarray | None:
        """A host-side draw that stage 0 of tensor ``t`` needs at ``step`` (None: none)."""
        return None

    def start(self, ctx: Context, t: TensorPlan, acc: Tensor, host: Tensor) -> Stage:
        """Stage 0 of a compressed tensor."""
        raise NotImplementedError

    def advance(self, ctx: Context, t: TensorPlan, round_: int, got: Message,
                carry: tuple) -> Stage:
        """Stage ``round_`` (from 1) of a compressed tensor, from what that round returned."""
        raise NotImplementedError

    def tensor_wire_bytes(self, t: TensorPlan) -> int:
        """Bytes this rank sends per step for compressed tensor ``t``."""
        raise NotImplementedError

    def wire_bytes(self) -> int:
        """Bytes each rank hands to Horovod per step (when it sends at all)."""
        dense = np.dtype(self.dense_dtype).itemsize
        return sum(self.tensor_wire_bytes(t) if t.compressed else dense * t.size
                   for t in self.tensors)

    def dense_bytes(self) -> int:
        """Bytes of the float32 gradients those stand for."""
        return 4 * sum(t.size for t in self.tensors)


class Half(Plan):
    """``fp16``: every tensor averaged as float16."""

    dense_dtype = "float16"


class _Sparse(Plan):
    """The shared selection rule of top-k and random-k."""

    dense = False
    feedback = True

    def compressible(self, shape: tuple[int, ...]) -> bool:
        return ref.large_enough(shape, self.comm.min_size)

    def k(self, t: TensorPlan) -> int:
        """How many entries of ``t`` are sent."""
        return ref.num_selected(t.size, self.comm.ratio if self.ratio is None else self.ratio)


class TopK(_Sparse):
    """``topk``, round 1: allgather float32 values and int32 indices; each rank scatter-adds all."""

    collective = "allgather"

    def start(self, ctx: Context, t: TensorPlan, acc: Tensor, host: Tensor) -> Stage:
        values, indices = ctx.kernels.topk_compress(acc, self.k(t))
        return Stage(Message(gather=(values, indices)),
                     sent=ctx.kernels.scatter(values, indices, t.size), picked=indices)

    def advance(self, ctx: Context, t: TensorPlan, round_: int, got: Message,
                carry: tuple) -> Stage:
        values, indices = got.gather
        return Stage(out=ctx.kernels.scatter(values, indices, t.size) / ctx.size)

    def tensor_wire_bytes(self, t: TensorPlan) -> int:
        return 8 * self.k(t)


class RandomK(_Sparse):
    """``randomk``, round 1: average the values at indices every rank draws alike on the host."""

    def host(self, t: TensorPlan, step: int, rank: int) -> np.ndarray:
        return ref.randomk_indices(t.size, self.k(t), self.seed, step, t.seed_index)

    def start(self, ctx: Context, t: TensorPlan, acc: Tensor, host: Tensor) -> Stage:
        scale = ref.randomk_scale(t.size, self.k(t), self.comm.error_feedback)
        values = ctx.kernels.randomk_compress(acc, host, scale)
        return Stage(Message(mean=(values,)), carry=(host,),
                     sent=ctx.kernels.scatter(values, host, t.size), picked=host)

    def advance(self, ctx: Context, t: TensorPlan, round_: int, got: Message,
                carry: tuple) -> Stage:
        return Stage(out=ctx.kernels.scatter(got.mean[0], carry[0], t.size))

    def tensor_wire_bytes(self, t: TensorPlan) -> int:
        return 4 * self.k(t)


class QSGD(Plan):
    """``qsgd``, round 1: allgather int8 codes and float32 scales; every rank decodes, averages."""

    dense = False
    collective = "allgather"

    def compressible(self, shape: tuple[int, ...]) -> bool:
        return ref.large_enough(shape, self.comm.min_size)

    def host(self, t: TensorPlan, step: int, rank: int) -> np.ndarray:
        return np.array(ref.noise_seed(self.seed, rank, step, t.seed_index), np.int64)

    def start(self, ctx: Context, t: TensorPlan, acc: Tensor, host: Tensor) -> Stage:
        noise = ctx.kernels.uniform(host, t.size)
        codes, scales = ctx.kernels.qsgd_compress(acc, self.comm.bucket, noise)
        # Its own decoded codes: error feedback, where an update rule keeps it (compressed Adam).
        sent = ctx.kernels.qsgd_mean(codes, scales, self.comm.bucket, 1) if ctx.feedback else None
        return Stage(Message(gather=(codes, scales)), sent=sent)

    def advance(self, ctx: Context, t: TensorPlan, round_: int, got: Message,
                carry: tuple) -> Stage:
        codes, scales = got.gather
        return Stage(out=ctx.kernels.qsgd_mean(codes, scales, self.comm.bucket, ctx.size))

    def tensor_wire_bytes(self, t: TensorPlan) -> int:
        return t.size + 4 * ref.qsgd_buckets(t.size, self.comm.bucket)


class PowerSGD(Plan):
    """``powersgd``: round 1 averages ``P = M Q``; round 2 averages ``M^T P`` (P orthogonalised),
    which becomes the shared ``Q`` (slot ``q/<i>``) and warm-starts the next step."""

    dense = False
    feedback = True
    rounds = 2

    def compressible(self, shape: tuple[int, ...]) -> bool:
        return (ref.large_enough(shape, self.comm.min_size)
                and ref.low_rank_pays(shape, self.comm.rank, self.out_last))

    def slots(self) -> list[Slot]:
        # The shared warm starts: Q at comm.rank and, under the adaptive rule, Q_LOW at its higher
        # rank, so that a switch resumes each level's subspace where that level left it.
        ranks = [(Q, self.comm.rank)]
        if self.comm.adaptive:
            ranks.append((Q_LOW, self.comm.rank * self.comm.adaptive_factor))
        return super().slots() + [
            Slot(kind, t.index, ref.powersgd_initial_q(t.shape, rank, self.seed, t.seed_index,
                                                       self.out_last))
            for kind, rank in ranks for t in self.tensors if t.compressed]

    def _q(self, t: TensorPlan) -> str:
        """The slot of ``t``'s warm start at this step's rank."""
        return slot_key(Q if self.rank is None else Q_LOW, t.index)

    def start(self, ctx: Context, t: TensorPlan, acc: Tensor, host: Tensor) -> Stage:
        m = ctx.kernels.reshape(acc, ref.matrix_shape(t.shape, self.out_last))
        p = ctx.kernels.matmul(m, ctx.store.read(self._q(t)))
        return Stage(Message(mean=(p,)), carry=(m,))

    def advance(self, ctx: Context, t: TensorPlan, round_: int, got: Message,
                carry: tuple) -> Stage:
        k = ctx.kernels
        if round_ == 1:
            (m,) = carry
            p = k.orthogonalize(got.mean[0])
            local_q = k.matmul(k.transpose(m), p)
            own = k.flat(k.matmul(p, k.transpose(local_q)))
            return Stage(Message(mean=(local_q,)), carry=(p,), sent=own)
        (p,), q = carry, got.mean[0]
        ctx.store.write(self._q(t), q)
        return Stage(out=k.flat(k.matmul(p, k.transpose(q))))

    def tensor_wire_bytes(self, t: TensorPlan) -> int:
        rows, cols = ref.matrix_shape(t.shape, self.out_last)
        rank = self.comm.rank if self.rank is None else self.rank
        return 4 * min(rank, rows, cols) * (rows + cols)

