"""Gradient compression for PyTorch: the kernels of :mod:`hvdtrain.compression.reference` in torch
and Horovod's torch collectives, which run the shared plans (:mod:`hvdtrain.compression.exchange`).

``none`` and ``fp16`` go through Horovod's DistributedOptimizer instead
(:mod:`hvdtrain.torch.exchange`); the other methods run :class:`CompressingExchange` once per
optimizer step, after all micro-batches' gradients have accumulated locally.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch

from hvdtrain.compression import make_plan
from hvdtrain.compression import reference as ref
from hvdtrain.compression.exchange import Exchange
from hvdtrain.compression.plans import CommSettings
from hvdtrain.compression.rules import OptimizerSettings
from hvdtrain.compression.state import Slot
from hvdtrain.torch.collectives import any_rank

_DTYPES = {"float32": torch.float32, "float16": torch.float16}


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


def randomk_compress(x: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """The entries of flat ``x`` at ``indices`` times ``scale``."""
    return x[indices.long()] * scale


def uniform(seed: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` draws from U[0, 1) by a generator seeded with ``seed`` alone (no state kept)."""
    return torch.rand(n, generator=torch.Generator().manual_seed(int(seed)))


def qsgd_compress(x: torch.Tensor, bucket: int, noise: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and float32 per-bucket scales of flat ``x``; ``noise``: U[0, 1), ``x``'s shape."""
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


def qsgd_mean(codes: torch.Tensor, scales: torch.Tensor, bucket: int, size: int) -> torch.Tensor:
    """The mean of ``size`` ranks' decoded vectors (codes and scales one rank after another),
    summed in rank order like the reference's."""
    n, b = codes.numel() // size, scales.numel() // size
    total = torch.zeros(n)
    for r in range(size):
        total += qsgd_decompress(codes[r * n:(r + 1) * n], scales[r * b:(r + 1) * b], bucket)
    return total / size


def _bucketed(flat: torch.Tensor, bucket: int) -> torch.Tensor:
    """``flat`` padded with zeros to whole buckets, one bucket per row (the reference's layout)."""
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


def zero_at(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Flat ``x`` with the entries at ``indices`` set to 0."""
    return x.reshape(-1).index_fill(0, indices.long(), 0.0)


def fill_zeros(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x`` with its entries that are exactly 0 taken from ``y``."""
    return torch.where(x != 0, x, y)


def square_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The squared global L2 norm of ``tensors``."""
    total = torch.zeros((), dtype=torch.float32)
    for t in tensors:
        total = total + torch.sum(t.float() * t.float())
    return total


def clip_factor(tensors: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The factor that brings the global L2 norm of ``tensors`` to at most ``max_norm``."""
    total = torch.zeros((), dtype=torch.float32)
    for t in tensors:
        total = total + torch.sum(t.float() * t.float())
    return torch.clamp(max_norm / (torch.sqrt(total) + 1e-6), max=1.0)


class Kernels:
    """The torch kernels as :class:`hvdtrain.compression.kernels.Kernels`."""

    out_last = False

    zero_at = staticmethod(zero_at)
    fill_zeros = staticmethod(fill_zeros)
    clip_factor = staticmethod(clip_factor)
    square_sum = staticmethod(square_sum)
    sqrt = staticmethod(torch.sqrt)

    topk_compress = staticmethod(topk_compress)
    scatter = staticmethod(scatter)
    randomk_compress = staticmethod(randomk_compress)
    uniform = staticmethod(uniform)
    qsgd_compress = staticmethod(qsgd_compress)
    qsgd_mean = staticmethod(qsgd_mean)
    orthogonalize = staticmethod(orthogonalize)

    @staticmethod
    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1)

    @staticmethod
    def reshape(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        return x.reshape(tuple(shape))

    @staticmethod
    def cast(x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.to(_DTYPES[dtype])

    @staticmethod
    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b

    @staticmethod
    def transpose(m: torch.Tensor) -> torch.Tensor:
        return m.t()


# state and collectives --------------------------------------------------------------------------

class TensorStore:
    """State slots as tensors (:class:`hvdtrain.compression.kernels.Store`)."""

    def __init__(self, slots: list[Slot]) -> None:
        self.tensors = {s.key: torch.from_numpy(s.initial.copy()) for s in slots}

    def read(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def write(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def numpy(self, key: str) -> np.ndarray:
        return self.tensors[key].numpy().copy()

    def assign(self, key: str, value: np.ndarray) -> None:
        self.tensors[key] = torch.from_numpy(np.array(value, np.float32))


class CompressingExchange(Exchange):
    """A plan run with torch kernels and Horovod's asynchronous torch collectives, among every
    rank or, for a pipeline stage, among the ranks of ``process_set`` (that stage's copies: then
    ``rank`` and ``size`` are the copy's place among them and their number, and ``root`` is the
    global rank of copy 0, whence broadcasts come)."""

    kernels = Kernels()

    def __init__(self, plan: Any, rank: int, size: int, opt: OptimizerSettings | None = None,
                 weights: Any = None, process_set: Any = None, root: int = 0) -> None:
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self.root = root
        super().__init__(plan, rank, size, opt, weights)

    def _make_store(self, slots: list[Slot]) -> TensorStore:
        return TensorStore(slots)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(array))

    def _nbytes(self, tensors: Sequence[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    def _collect(self, tag: str, gather: list[torch.Tensor], mean: list[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # All started before any is waited for: Horovod fuses and overlaps them.
        group = self.process_set
        gathering = [hvd.allgather_async(t, name=f"hvdtrain.{tag}.gather.{j}", process_set=group)
                     for j, t in enumerate(gather)]
        averaging = [hvd.allreduce_async(t, op=hvd.Average, name=f"hvdtrain.{tag}.mean.{j}",
                                         process_set=group)
                     for j, t in enumerate(mean)]
        return ([hvd.synchronize(h) for h in gathering], [hvd.synchronize(h) for h in averaging])

    def _allgather_rows(self, array: np.ndarray, name: str) -> np.ndarray:
        return hvd.allgather(torch.from_numpy(array[None]), name=name,
                             process_set=self.process_set).numpy()

    def any_rank(self, flag: bool) -> bool:
        return any_rank(flag, self.process_set)

    def _broadcast(self, array: np.ndarray, root_rank: int, name: str) -> np.ndarray:
        # Within a stage's set the root is its copy 0, named by its global rank.
        root = self.root if self.process_set is not hvd.global_process_set else root_rank
        return hvd.broadcast(torch.from_numpy(np.ascontiguousarray(array)), root,
                             name=name, process_set=self.process_set).numpy()


def make_compressing(comm: CommSettings, seed: int, rank: int, size: int,
                     params: Sequence[torch.Tensor], opt: OptimizerSettings | None = None,
                     process_set: Any = None, root: int = 0,
                     places: Sequence[int] | None = None) -> CompressingExchange:
    """The exchange for ``comm.compression`` over the gradients of ``params`` (the model's order);
    ``opt``: the run's optimizer, where the exchange may apply its update rule; ``process_set``,
    ``root`` and ``places``: a pipeline stage's copies, the global rank of copy 0 (see
    :class:`CompressingExchange`) and the stage's tensors' places in the whole model."""
    params = list(params)
    plan = make_plan(comm, seed, [p.shape for p in params], places)
    return CompressingExchange(plan, rank, size, opt, lambda: [p.detach() for p in params],
                               process_set, root)


def with_optimizer(exchange: CompressingExchange, optimizer: torch.optim.Optimizer
                   ) -> torch.optim.Optimizer:
    """The optimizer a step drives with ``exchange``: plain SGD where the exchange applies the
    optimizer's update rule itself (DGC, compressed Adam), else ``optimizer``."""
    opt = optimizer_settings(optimizer)
    return plain_sgd(optimizer, opt) if exchange.rule.updates and opt is not None else optimizer


def optimizer_settings(optimizer: torch.optim.Optimizer) -> OptimizerSettings | None:
    """What an update rule needs of ``optimizer`` (None for one it does not know)."""
    group = optimizer.param_groups[0]
    name = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam",
            torch.optim.AdamW: "adamw"}.get(type(optimizer))
    if name is None or group.get("nesterov") or group.get("amsgrad"):
        return None
    beta1, beta2 = group.get("betas", (0.9, 0.999))
    return OptimizerSettings(name, momentum=float(group.get("momentum", 0.0)),
                             weight_decay=float(group.get("weight_decay", 0.0)),
                             beta1=float(beta1), beta2=float(beta2),
                             eps=float(group.get("eps", 1e-8)))


def plain_sgd(optimizer: torch.optim.Optimizer, opt: OptimizerSettings) -> torch.optim.Optimizer:
    """The optimizer that applies an update rule's directions: SGD without momentum or decay over
    the same parameters (the rule's directions include the decay: L2 for SGD and Adam, AdamW's
    decoupled term)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return torch.optim.SGD(params, lr=optimizer.param_groups[0]["lr"], momentum=0.0)


def to_torch(entry: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """A :meth:`CompressingExchange.state_dict` entry as ``torch.load(weights_only=True)`` reads
    it: tensors, and the method name as a string. :meth:`CompressingExchange.load_state_dict`
    takes it."""
    return {k: str(v) if v.dtype.kind == "U" else torch.from_numpy(v) for k, v in entry.items()}
