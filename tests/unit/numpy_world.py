"""A framework-free world for the unit tier: simulated ranks in threads (:class:`Hub`), the
compressing exchange with the reference functions as kernels (:class:`NumpyExchange`), and a
NumPy engine (:class:`NumpyEngine`): softmax regression trained by the core's own step skeleton
(:func:`hvdtrain.step.train_step`), so that the loop, session, driver, checkpoint and elastic
policies run for real with no framework and no Horovod.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from hvdtrain.compression import make_plan
from hvdtrain.compression import reference as ref
from hvdtrain.compression.exchange import Exchange
from hvdtrain.compression.rules import OptimizerSettings
from hvdtrain.compression.state import Slot
from hvdtrain.config import Config
from hvdtrain.data.contracts import Dataset
from hvdtrain.data.sampler import StepIndices
from hvdtrain.engine import Collectives, Engine
from hvdtrain.errors import HvdtrainError
from hvdtrain.step import PrecisionKernels, StepKernels, add_batch_sums, train_step

F32 = np.float32


class NumpyKernels:
    """The kernels protocol with the reference functions."""

    topk_compress = staticmethod(ref.topk_compress)
    scatter = staticmethod(ref.scatter)
    randomk_compress = staticmethod(ref.randomk_compress)
    qsgd_compress = staticmethod(ref.qsgd_compress)
    orthogonalize = staticmethod(ref.orthogonalize)
    zero_at = staticmethod(ref.zero_at)
    fill_zeros = staticmethod(ref.fill_zeros)
    clip_factor = staticmethod(ref.clip_factor)
    square_sum = staticmethod(ref.square_sum)
    sqrt = staticmethod(np.sqrt)

    @staticmethod
    def flat(x: np.ndarray) -> np.ndarray:
        return x.reshape(-1)

    @staticmethod
    def reshape(x: np.ndarray, shape: Sequence[int]) -> np.ndarray:
        return x.reshape(tuple(shape))

    @staticmethod
    def cast(x: np.ndarray, dtype: str) -> np.ndarray:
        return x.astype(dtype)

    @staticmethod
    def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a @ b

    @staticmethod
    def transpose(m: np.ndarray) -> np.ndarray:
        return m.T

    @staticmethod
    def uniform(seed: np.ndarray, n: int) -> np.ndarray:
        return noise(int(seed), n)

    @staticmethod
    def qsgd_mean(codes: np.ndarray, scales: np.ndarray, bucket: int, size: int) -> np.ndarray:
        return ref.qsgd_mean(list(zip(np.split(codes, size), np.split(scales, size), strict=True)), bucket)


def noise(seed: int, n: int) -> np.ndarray:
    """``n`` draws from U[0, 1) seeded by ``seed`` alone."""
    return np.random.Generator(np.random.Philox(seed)).random(n, dtype=F32)


class DictStore:
    """State slots as NumPy arrays."""

    def __init__(self, slots: list[Slot]) -> None:
        self.arrays = {s.key: s.initial.copy() for s in slots}

    def read(self, key: str) -> np.ndarray:
        return self.arrays[key]

    def write(self, key: str, value: np.ndarray) -> None:
        self.arrays[key] = value

    def numpy(self, key: str) -> np.ndarray:
        return self.arrays[key].copy()

    def assign(self, key: str, value: np.ndarray) -> None:
        self.arrays[key] = np.array(value, F32)


class Hub:
    """Collectives between threads: every rank posts, all read every post."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.posts: list[Any] = [None] * size

    def all(self, rank: int, value: Any) -> list[Any]:
        self.posts[rank] = value
        self.barrier.wait()
        out = list(self.posts)
        self.barrier.wait()
        return out


class NumpyExchange(Exchange):
    """A method's plan run with the reference functions, between the threads of a :class:`Hub`."""

    kernels = NumpyKernels()

    def __init__(self, plan: Any, rank: int, size: int, hub: Hub,
                 opt: OptimizerSettings | None = None,
                 weights: Callable[[], Sequence[np.ndarray]] | None = None) -> None:
        self.hub = hub
        super().__init__(plan, rank, size, opt, weights)

    def _make_store(self, slots: list[Slot]) -> DictStore:
        return DictStore(slots)

    def _tensor(self, array: np.ndarray) -> np.ndarray:
        return np.asarray(array)

    def _nbytes(self, tensors: Sequence[np.ndarray]) -> int:
        return sum(t.nbytes for t in tensors)

    def _collect(self, tag: str, gather: list, mean: list) -> tuple[list, list]:
        posts = self.hub.all(self.rank, (gather, mean))
        return ([np.concatenate([p[0][j] for p in posts]) for j in range(len(gather))],
                [ref.dense_mean([p[1][j] for p in posts]) for j in range(len(mean))])

    def _allgather_rows(self, array: np.ndarray, name: str) -> np.ndarray:
        return np.stack(self.hub.all(self.rank, array))

    def _broadcast(self, array: np.ndarray, root_rank: int, name: str) -> np.ndarray:
        return self.hub.all(self.rank, array)[root_rank]

    def any_rank(self, flag: bool) -> bool:
        return any(self.hub.all(self.rank, flag))


class HubCollectives(Collectives):
    """The loop's collectives between the threads of a :class:`Hub` (one thread: one process)."""

    def __init__(self, rank: int, hub: Hub) -> None:
        self._rank, self.hub = rank, hub

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self.hub.posts)

    def local_rank(self) -> int:
        return self._rank

    def local_size(self) -> int:
        return self.size()

    def start_allreduce_sums(self, sums: dict[str, float]) -> Callable[[], dict[str, float]]:
        posts = self.hub.all(self._rank, dict(sums))
        total = {key: sum(p[key] for p in posts) for key in sorted(sums)}
        return lambda: total

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        return self.hub.all(self._rank, obj)[root_rank]

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.hub.all(self._rank, obj)

    def elastic_run(self, func: Callable[..., Any]) -> Callable[..., Any]:
        raise HvdtrainError("the NumPy world has no elastic runner: elastic mode needs Horovod")


class Fp32(PrecisionKernels):
    """float32 throughout: nothing scaled, nothing skipped; the update is SGD with momentum."""

    scaling = False

    def __init__(self, engine: NumpyEngine) -> None:
        self.engine = engine

    def finite(self, grads: Sequence[np.ndarray]) -> bool:
        return all(bool(np.isfinite(g).all()) for g in grads)

    def unscale(self, grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        return list(grads)

    def update(self, grads: Sequence[np.ndarray], unscaled: bool) -> None:
        self.engine.sgd(grads)

    def skip(self) -> None:
        raise AssertionError("fp32 never skips a step")

    @property
    def skipped(self) -> bool:
        return False


class NumpyEngine(Engine, StepKernels):
    """Softmax regression on a classification dataset, as both the engine and its step kernels.

    It stands in for the configured framework (``framework`` is the config's), so that a
    checkpoint it writes resumes a run of the same config. The exchange is the config's
    compression method run by :class:`NumpyExchange`.
    """

    def __init__(self, cfg: Config, dataset: Dataset, rank: int = 0, hub: Hub | None = None) -> None:
        hub = hub or Hub(1)
        self.framework, self.cycle_time_ms = cfg.framework, "1"
        self.collectives = HubCollectives(rank, hub)
        self.rank, self.size = rank, len(hub.posts)
        self.local_rank, self.local_size = rank, self.size
        self.dataset, self.momentum = dataset, cfg.optim.momentum
        spec = dataset.spec()
        rng = np.random.default_rng(cfg.seed + rank)  # ranks differ until the broadcast
        features = int(np.prod(spec.input_shape))
        self.params = [rng.normal(0, 0.01, (features, spec.num_classes)).astype(F32),
                       np.zeros(spec.num_classes, F32)]
        self.velocity = [np.zeros_like(p) for p in self.params]
        self.grads = [np.zeros_like(p) for p in self.params]
        self.precision = Fp32(self)
        opt = OptimizerSettings(cfg.optim.name, momentum=cfg.optim.momentum,
                                weight_decay=cfg.optim.weight_decay)
        self.exchange = NumpyExchange(make_plan(cfg.comm, cfg.seed, [p.shape for p in self.params]),
                                      rank, self.size, hub, opt, lambda: self.params)
        if self.exchange.rule.updates:  # the exchange applies the optimizer's rule: plain SGD here
            self.momentum = 0.0
        elif cfg.optim.name != "sgd" or cfg.optim.weight_decay:
            raise HvdtrainError("the NumPy engine runs SGD without decay, or an exchange's rule")
        self.lr, self.stats = 0.0, {}

    # the step's kernels

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def batches(self, step: StepIndices) -> Iterator[Any]:
        train = self.dataset.train()
        for micro in step.micro:
            batch = train.load(micro)
            yield batch.x.reshape(len(micro), self.params[0].shape[0]), batch.y  # empty ones too

    def begin(self) -> None:
        self.grads = [np.zeros_like(p) for p in self.params]

    def _scores(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float, float]:
        logits = x @ self.params[0] + self.params[1]
        logits -= logits.max(axis=1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=1, keepdims=True)
        loss = -np.log(probs[np.arange(len(y)), y] + 1e-12).sum()
        return probs, float(loss), float((probs.argmax(axis=1) == y).sum())

    def backward(self, batch: Any, weight: float, last: bool) -> tuple[Any, dict[str, Any]]:
        x, y = batch
        probs, loss, correct = self._scores(x, y)
        probs[np.arange(len(y)), y] -= 1.0
        delta = (probs * weight).astype(F32)
        self.grads[0] += x.T @ delta
        self.grads[1] += delta.sum(axis=0)
        return loss, {"correct": correct}

    def gradients(self) -> list[np.ndarray]:
        return self.grads

    def sgd(self, grads: Sequence[np.ndarray]) -> None:
        """SGD with momentum, as torch's: v = m v + g, p -= lr v."""
        for p, v, g in zip(self.params, self.velocity, grads, strict=True):
            v *= self.momentum
            v += g
            p -= F32(self.lr) * v

    # the engine

    def train_step(self, step: StepIndices, lr: float) -> dict[str, float]:
        result = train_step(self, self.exchange, step, lr, self.size)
        self.stats = result.stats
        return result.sums

    def step_stats(self) -> dict[str, float]:
        return dict(self.stats)

    def evaluate(self, batches: Iterable[np.ndarray]) -> dict[str, float]:
        sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
        test = self.dataset.test()
        for idx in batches:
            batch = test.load(idx)
            _, loss, correct = self._scores(batch.x.reshape(len(idx), self.params[0].shape[0]), batch.y)
            add_batch_sums(sums, loss, {"correct": correct}, len(idx))
        return sums

    def state_bytes(self, meta: dict[str, Any]) -> bytes:
        arrays = {f"param/{i}": p for i, p in enumerate(self.params)}
        arrays |= {f"velocity/{i}": v for i, v in enumerate(self.velocity)}
        arrays |= {f"compression/{k}": v for k, v in self.exchange.state_dict().items()}
        buffer = io.BytesIO()
        np.savez(buffer, meta=np.array(json.dumps(meta)), **arrays)
        return buffer.getvalue()

    def load_state(self, data: bytes, where: str) -> dict[str, Any]:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        self.params = [arrays[f"param/{i}"].copy() for i in range(len(self.params))]
        self.velocity = [arrays[f"velocity/{i}"].copy() for i in range(len(self.velocity))]
        self.exchange.load_state_dict({k[12:]: v for k, v in arrays.items()
                                       if k.startswith("compression/")}, where)
        return json.loads(str(arrays["meta"]))

    def gather_state(self) -> None:
        self.exchange.gather()

    def broadcast_state(self) -> None:
        self.params, self.velocity = self.collectives.broadcast_object((self.params, self.velocity))
        self.params = [p.copy() for p in self.params]
        self.velocity = [v.copy() for v in self.velocity]
        self.exchange.resize(self.rank, self.size)
        self.exchange.broadcast(root_rank=0)

    def fork_rng(self, seed: int, step: int) -> None:
        """Nothing to fork: training draws no random numbers."""

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        self.rank, self.size = rank, size
        self.exchange.resize(rank, size, accumulation)

    def parameters(self) -> dict[str, np.ndarray]:
        return {"weight": self.params[0].copy(), "bias": self.params[1].copy()}

    def versions(self) -> dict[str, str]:
        return {"numpy": np.__version__}
