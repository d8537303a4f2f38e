"""The ``ps`` gradient exchange, framework-free: the flat gradient pushed to the servers, its sum
pulled back and divided by the number of workers.

That is the ring's average: Horovod's ``Average`` sums, then multiplies by ``1 / size`` in double
precision, and so does :meth:`PSExchange.run`; with ``bsp`` the workers step their own optimizers
with it, so a ``ps`` run trains as a ``ring`` run of the same workers. A framework supplies the
conversions between its gradients and one flat float32 NumPy vector, and its Horovod ``any_rank``
(:mod:`hvdtrain.torch.ps`, :mod:`hvdtrain.tensorflow.ps`).

Under ``ssp``/``asp`` (:class:`AsyncPSExchange`) the servers run the optimizer: each worker
pushes its own gradient and takes the parameters it pulls, and its framework optimizer does not
step.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdtrain.compression.plans import CommSettings
from hvdtrain.compression.state import RESIDUAL, Slot, pack, unpack
from hvdtrain.config import PSConfig
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import GradientExchange, empty_stats
from hvdtrain.ps.client import AsyncPSClient, PSClient
from hvdtrain.ps.codec import WireSettings
from hvdtrain.ps.layout import server_chunk
from hvdtrain.ps.mpi import split
from hvdtrain.ps.optim import OPTIMIZERS
from hvdtrain.ps.shards import state_names

WIRES = {"fp16": "float16"}
"""The dtype dense chunks travel as, by ``comm.compression`` (float32 for every other method)."""


def ps_stats(client: PSClient, comm_s: float, convert_s: float) -> dict[str, float]:
    """A step's measurements: the ring's keys (``wire_bytes`` and ``dense_bytes``, the float32
    bytes they stand for, count both directions) and the bytes per direction, ``push_bytes`` and
    ``pull_bytes``."""
    wire = float(client.pushed_bytes + client.pulled_bytes)
    dense = 2.0 * 4 * client.layout.total
    return {**empty_stats(), "wire_bytes": wire, "dense_bytes": dense, "comm_s": comm_s,
            "compress_s": convert_s, "push_bytes": float(client.pushed_bytes),
            "pull_bytes": float(client.pulled_bytes)}


class PSExchange(GradientExchange):
    """Dedicated parameter servers summing the gradients (``ps.consistency=bsp``).

    With a compressing method (:mod:`hvdtrain.ps.codec`) it has state, which a checkpoint's
    compression entry holds as the ring's does (:func:`hvdtrain.compression.state.pack`): the
    step, which seeds random-k's indices and qsgd's noise, and under error feedback every
    worker's push residuals as the ring's per-tensor slots (``residual/<i>``, a row per worker:
    a ring run resumes with them, and this exchange with the ring's) and the servers' pull
    residuals (``topk``) as one whole vector (:data:`SERVER_RESIDUAL`: any number of servers
    resumes it)."""

    def __init__(self, client: PSClient, rank: int, size: int,
                 shapes: Sequence[Sequence[int]], overlap: bool = False) -> None:
        self.client, self.rank, self.size = client, rank, size
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.offsets = np.cumsum([0, *self.sizes]).tolist()
        self.stats = empty_stats()
        self.method = client.settings.method
        self.compressing = client.settings.compressing
        # Residuals stay in the gradients' units whatever a loss scale does (as on the ring).
        self.unscaled_first = self.compressing
        self.streams = overlap and not self.compressing
        """Whether chunks leave during the backward pass: ``overlap`` (a framework that reports
        each gradient as the pass produces it, :meth:`produced`) and a dense method (a
        compressed push needs the unscaled gradients, which exist only after the pass)."""
        self.saved: dict[str, np.ndarray] | None = None
        self.restored: tuple[int, tuple[np.ndarray, np.ndarray | None] | None] = (0, None)
        """The step and the residuals (push rows, server vector) rank 0 resumed with."""
        self.buffer = np.empty(0, np.float32)
        """Streaming: the flat gradient the backward pass writes (:meth:`produced`), allocated
        at the first streamed step."""
        self.streaming = False
        self.written = [False] * len(self.sizes)

    def backward_starts(self, last: bool) -> None:
        """Before the step's last backward pass: starts the client's step over :attr:`buffer`,
        into which :meth:`produced` then writes each gradient as it is ready (where it
        :attr:`streams`)."""
        if last and self.streams:
            if self.buffer.size != self.client.layout.total:
                self.buffer = np.empty(self.client.layout.total, np.float32)
            self.written = [False] * len(self.sizes)
            self.client.begin(self.buffer)
            self.streaming = True

    def produced(self, index: int, grad: Any) -> None:
        """The framework's hook: gradient ``index`` is final for this step; its chunks may leave
        once the other gradients they hold are too."""
        if not self.streaming or self.written[index]:
            return
        start, stop = self.offsets[index], self.offsets[index + 1]
        self.write(grad, self.buffer[start:stop])
        self.written[index] = True
        self.client.filled(start, stop)

    def run(self, grads: Sequence[Any]) -> list[Any]:
        started = time.perf_counter()
        if self.streaming:
            for index, grad in enumerate(grads):  # those no hook reported (unused parameters)
                self.produced(index, grad)
            sent = time.perf_counter()
            self.streaming = False
            summed = self.client.end()
        else:
            flat = self.flatten(grads)
            sent = time.perf_counter()
            summed = self.client.push_pull(flat)
        pulled = time.perf_counter()
        # As Horovod's Average: the sum times 1 / size, computed in double, rounded to float32
        # (the sum arrives in the wire dtype: float16 under fp16, as Horovod's fp16 sends it).
        # One ufunc with a float64 scale and a float32 output does just that, element by
        # element, without the two whole-vector temporaries of astype.
        mean = np.multiply(summed, np.float64(1.0 / self.size),
                           out=np.empty(summed.shape, np.float32), casting="same_kind")
        out = self.unflatten(mean)
        convert = (sent - started) + (time.perf_counter() - pulled)
        self.stats = ps_stats(self.client, pulled - sent, convert)
        return out

    def write(self, grad: Any, out: np.ndarray) -> None:
        """Copies one gradient into ``out`` (its place in the flat vector), where it
        :attr:`streams`."""
        raise NotImplementedError(f"{type(self).__name__} does not stream its gradients")

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """``flat`` cut into the gradients' shapes (views)."""
        bounds = self.offsets
        return [flat[a:b].reshape(shape)
                for a, b, shape in zip(bounds[:-1], bounds[1:], self.shapes, strict=True)]

    @abc.abstractmethod
    def flatten(self, grads: Sequence[Any]) -> np.ndarray:
        """The gradients as one contiguous float32 vector, in model order."""

    @abc.abstractmethod
    def unflatten(self, flat: np.ndarray) -> list[Any]:
        """``flat`` as the framework's gradients, in the shapes given."""

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        if (rank, size) != (self.rank, self.size):
            raise HvdtrainError("comm.topology=ps cannot change its number of workers")

    def finish(self) -> None:
        """Tells the servers this training ended (the driver calls it on every worker)."""
        self.client.finish()

    def slots(self) -> list[Slot]:
        """The ring's residual slots, one per tensor, that hold the push residuals."""
        return [Slot(RESIDUAL, i, np.zeros(n, np.float32)) for i, n in enumerate(self.sizes)]

    def gather(self) -> None:
        """Every worker, before a checkpoint: worker 0 collects the residuals of every worker and
        server (a collective of the workers and servers)."""
        if not self.compressing:
            return
        fetched = self.client.fetch_residuals()
        arrays: dict[str, np.ndarray] = {}
        if fetched is not None:
            rows, server = fetched
            bounds = self.offsets
            arrays = {s.key: rows[:, a:b] for s, a, b in zip(self.slots(), bounds[:-1],
                                                              bounds[1:], strict=True)}
            if server is not None:
                arrays[SERVER_RESIDUAL] = server
        self.saved = pack(self.method, self.client.step, arrays)

    def state_dict(self) -> dict[str, np.ndarray] | None:
        return self.saved if self.compressing else None

    def load_state_dict(self, entry: Mapping[str, Any] | None, where: str) -> None:
        if not entry or not self.compressing:
            return
        saved = unpack(entry, self.method, self.slots(), where)
        residuals = None
        settings = self.client.settings
        if settings.feedback and (saved.rows or SERVER_RESIDUAL in entry):
            server = self._server_residual(entry, where) if settings.server_feedback else None
            residuals = (self._rows(saved.rows), server)
        self.restored = (saved.step, residuals)

    def _rows(self, rows: Mapping[str, np.ndarray]) -> np.ndarray:
        """The push residuals as rows of whole flat vectors, from the per-tensor slots saved (a
        tensor the ring did not compress has none: zeros)."""
        count = next(iter(rows.values())).shape[0] if rows else 1
        parts = [np.asarray(rows[s.key], np.float32).reshape(count, -1) if s.key in rows
                 else np.zeros((count, s.initial.size), np.float32) for s in self.slots()]
        return np.ascontiguousarray(np.concatenate(parts, axis=1))

    def _server_residual(self, entry: Mapping[str, Any], where: str) -> np.ndarray:
        """The servers' pull residuals saved (a ring checkpoint has none: zeros)."""
        total = self.client.layout.total
        server = np.asarray(entry.get(SERVER_RESIDUAL, np.zeros(total)), np.float32).reshape(-1)
        if server.size != total:
            raise HvdtrainError(f"{where}: its parameter servers' residuals hold {server.size} "
                                f"elements, the model {total}")
        return np.ascontiguousarray(server)

    def broadcast(self, root_rank: int = 0) -> None:
        """Every worker, before the first step: worker 0 hands the others and the servers the step
        and residuals it resumed with (nothing for the dense methods, which keep no state)."""
        if self.compressing:
            self.client.restore(*self.restored)


def make_client(ps: PSConfig, comm: CommSettings, shapes: Sequence[Sequence[int]],
                seed: int = 0) -> PSClient:
    """The worker's client for gradients of these shapes, sent as ``comm.compression`` says
    (``seed``: the run's, for random draws); starts the training on the servers. Under
    ``ssp``/``asp`` an :class:`AsyncPSClient` (dense methods only)."""
    total = sum(int(np.prod(s)) for s in shapes)
    args = (split(ps.servers), total, server_chunk(total, ps.chunk_kib), ps.timeout_s,
            WIRES.get(comm.compression, "float32"))
    if ps.consistency == "bsp":
        settings = WireSettings(comm.compression, comm.ratio, comm.error_feedback, comm.bucket,
                                comm.min_size, seed)
        return PSClient(*args, settings=settings)
    return AsyncPSClient(*args, consistency=ps.consistency, staleness=ps.staleness)


@dataclass(frozen=True)
class ServerOptimizer:
    """The ``optim`` settings the servers' optimizer runs with (``INIT``'s hyper-parameters)."""

    name: str
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    @property
    def names(self) -> tuple[str, ...]:
        """The state vectors it keeps."""
        return state_names(self.name, self.momentum)

    def hyper(self) -> np.ndarray:
        """``INIT``'s float64 row."""
        return np.array([OPTIMIZERS.index(self.name), self.momentum, self.weight_decay,
                         *self.betas, self.eps], np.float64)


SERVER_RESIDUAL = "ps_server_residual"
"""Key of the servers' pull residuals (one whole flat vector) in a checkpoint's compression entry
(``bsp``, ``topk`` with error feedback)."""

STATE_PREFIX = "ps_"
"""Keys of the servers' optimizer state in a checkpoint's exchange entry: ``ps_steps`` and one
whole flat vector per state name (``ps_momentum``, ``ps_exp_avg``, ``ps_exp_avg_sq``)."""


class AsyncPSExchange(PSExchange):
    """``ps.consistency=ssp``/``asp``: each step pushes this worker's gradient and takes the
    parameters pulled back; the servers' optimizer applies it, so the worker's own must not
    (its framework gives this exchange an optimizer whose step does nothing).

    A push carries one worker's share of the global batch, and ``optim.scale_lr`` scaled the
    learning rate for all of it, so a push is applied with the schedule's rate divided by the
    number of workers: with SGD, one push from every worker then moves the parameters as one
    ``bsp`` step does.
    """

    client: AsyncPSClient

    def __init__(self, client: AsyncPSClient, rank: int, size: int,
                 shapes: Sequence[Sequence[int]], optimizer: ServerOptimizer) -> None:
        super().__init__(client, rank, size, shapes)
        self.optimizer = optimizer
        self.resumed: tuple[int, dict[str, np.ndarray]] = (0, {})
        """The servers' steps and state from the checkpoint rank 0 resumed from."""
        self.saved: dict[str, np.ndarray] | None = None
        self.started = False

    def run(self, grads: Sequence[Any]) -> list[Any]:
        if not self.started:
            raise HvdtrainError("ps.consistency: the servers' optimizer was not started "
                                "(broadcast() must run before the first step)")
        began = time.perf_counter()
        flat = self.flatten(grads)
        sent = time.perf_counter()
        params = self.client.push_pull(flat, self.learning_rate() / self.size)
        pulled = time.perf_counter()
        self.assign(params)
        convert = (sent - began) + (time.perf_counter() - pulled)
        stale = float(self.client.staleness)
        self.stats = {**ps_stats(self.client, pulled - sent, convert), "pushes": 1.0,
                      "staleness_sum": stale, "staleness_max": stale}
        return list(grads)

    def broadcast(self, root_rank: int = 0) -> None:
        """After the parameters were broadcast: worker 0 starts the servers' optimizers with
        them (and, resumed, with the checkpoint's state)."""
        if self.rank == root_rank:
            steps, state = self.resumed
            self.client.init(self.flat_params(), self.optimizer.hyper(), steps, state,
                             self.optimizer.names)
        self.started = True

    def gather(self) -> None:
        """Worker 0 fetches the servers' parameters (into its model, so that the checkpoint's
        model and optimizer state belong together) and their optimizer state."""
        if self.rank != 0:
            return
        steps, state = self.client.fetch_state(self.optimizer.names)
        self.assign(self.client.params)
        self.saved = {f"{STATE_PREFIX}steps": np.array(steps, np.int64),
                      **{f"{STATE_PREFIX}{n}": v for n, v in state.items()}}

    def state_dict(self) -> dict[str, np.ndarray] | None:
        return self.saved

    def load_state_dict(self, entry: Mapping[str, Any] | None, where: str) -> None:
        if not entry or f"{STATE_PREFIX}steps" not in entry:
            self.resumed = (0, {})  # a checkpoint of bsp or a fresh start: the servers start anew
            return
        state = {}
        for name in self.optimizer.names:
            value = entry.get(f"{STATE_PREFIX}{name}")
            if value is None:
                continue  # before the first step the servers keep none
            array = np.ascontiguousarray(np.asarray(value), np.float32).reshape(-1)
            if array.size != self.client.layout.total:
                raise HvdtrainError(f"{where}: its parameter servers' {name} holds {array.size} "
                                    f"elements, the model {self.client.layout.total}")
            state[name] = array
        if state and len(state) != len(self.optimizer.names):
            raise HvdtrainError(f"{where}: its parameter servers' optimizer state "
                                f"({sorted(state)}) is not optim.name={self.optimizer.name!r}'s")
        self.resumed = (int(np.asarray(entry[f"{STATE_PREFIX}steps"])), state)

    @abc.abstractmethod
    def learning_rate(self) -> float:
        """The step's learning rate (the schedule's, as the loop set it on the optimizer)."""

    @abc.abstractmethod
    def flat_params(self) -> np.ndarray:
        """The model's trainable parameters as one contiguous float32 vector, in model order."""

    @abc.abstractmethod
    def assign(self, flat: np.ndarray) -> None:
        """Sets the model's trainable parameters from ``flat``."""
