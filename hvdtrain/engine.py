"""The engine contract: what the framework-free loop, resuming and elastic mode need from a framework.

Split by job: :class:`Step` (train, evaluate), :class:`Collectives` (Horovod's, one object per
engine), :class:`StateIO` (the training state to and from bytes) and :meth:`Engine.resize`. The
framework packages implement them in files of the same names: ``engine.py`` and ``collectives.py``.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import numpy as np

from hvdtrain.config import Config
from hvdtrain.data.contracts import Dataset
from hvdtrain.data.sampler import StepIndices
from hvdtrain.errors import HvdtrainError
from hvdtrain.strategies.table import engine_path


class Collectives(abc.ABC):
    """Horovod's collectives of one framework, as the loop, resuming and elastic mode use them.

    Rank and sizes are read from Horovod on every call, so they follow an elastic reset. Elastic
    mode hands this same object's ``broadcast_object`` and ``rank`` to its state.
    """

    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank."""

    @abc.abstractmethod
    def size(self) -> int:
        """The number of ranks."""

    @abc.abstractmethod
    def local_rank(self) -> int:
        """This process's rank among the ranks on its host."""

    @abc.abstractmethod
    def local_size(self) -> int:
        """The number of ranks on this host."""

    @abc.abstractmethod
    def start_allreduce_sums(self, sums: dict[str, float]) -> Callable[[], dict[str, float]]:
        """Starts summing each value over all ranks (one collective for the whole dict).

        Returns a function that waits for the result. Starting it before the next training step
        lets Horovod carry it beside that step's gradients instead of stopping the ranks for it.
        """

    def allreduce_sums(self, sums: dict[str, float]) -> dict[str, float]:
        """Sums each value over all ranks and waits for the result."""
        return self.start_allreduce_sums(sums)()

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        """Rank ``root_rank``'s ``obj`` on every rank (pickled)."""

    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""

    @abc.abstractmethod
    def elastic_run(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """Horovod's ``hvd.elastic.run`` of this framework: ``func(state, ...)`` restarted from the
        last commit after every reset."""


class HorovodCollectives(Collectives):
    """What ``horovod.torch`` and ``horovod.tensorflow`` offer under the same names, given the
    module; the framework packages add the sums and the elastic runner."""

    def __init__(self, hvd: Any) -> None:
        self._hvd = hvd

    def rank(self) -> int:
        return self._hvd.rank()

    def size(self) -> int:
        return self._hvd.size()

    def local_rank(self) -> int:
        return self._hvd.local_rank()

    def local_size(self) -> int:
        return self._hvd.local_size()

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        return self._hvd.broadcast_object(obj, root_rank=root_rank)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._hvd.allgather_object(obj)


class Step(abc.ABC):
    """The computation: one optimizer step and scoring the test split."""

    @abc.abstractmethod
    def train_step(self, step: StepIndices, lr: float) -> dict[str, float]:
        """Runs one optimizer step; returns this rank's sums (``loss``, ``count``, metrics)."""

    def step_stats(self) -> dict[str, float]:
        """Measurements of this rank's last :meth:`train_step` (empty when an engine has none).

        ``data_s``: waiting for the step's batches (what the loader's prefetching did not hide);
        ``compute_s``: forward, backward, update and compression kernels; ``compress_s``: the part
        of it in compression kernels (methods that compress only); ``comm_s``: time spent waiting
        for the gradient exchange's Horovod collectives; ``wire_bytes``: bytes of the tensors handed
        to Horovod for that exchange; ``dense_bytes``: bytes of the dense gradients they stand for.
        """
        return {}

    @abc.abstractmethod
    def evaluate(self, batches: Iterable[np.ndarray]) -> dict[str, float]:
        """Scores the test samples of these index batches; returns this rank's sums."""


class StateIO(abc.ABC):
    """The training state (model, optimizer, random states, compression state) to and from bytes,
    and its agreement across ranks."""

    @abc.abstractmethod
    def state_bytes(self, meta: dict[str, Any]) -> bytes:
        """This rank's state and ``meta``, serialised (a checkpoint file's contents)."""

    @abc.abstractmethod
    def load_state(self, data: bytes, where: str) -> dict[str, Any]:
        """Restores the state from :meth:`state_bytes`'s output and returns its ``meta``; never runs
        code from ``data``. ``where`` names the source in errors."""

    def shard_part(self) -> tuple[str, dict[str, Any], Callable[[IO[bytes]], object]] | None:
        """This rank's part of a checkpoint that every rank writes (sharded data parallel, its own
        shards: :mod:`hvdtrain.shard_files`): its label, the fields its manifest entry adds and a
        function that writes it; None (here) where rank 0 writes the state after
        :meth:`gather_state`. Called on every rank before a checkpoint."""
        return None

    def gather_state(self) -> None:
        """Called on every rank just before rank 0 serialises: collects the state that differs
        between ranks (error-feedback residuals) onto rank 0. A collective; no-op here."""

    @abc.abstractmethod
    def broadcast_state(self) -> None:
        """Gives every rank rank 0's state (initial or restored); a collective."""

    @abc.abstractmethod
    def fork_rng(self, seed: int, step: int) -> None:
        """Gives this rank its own random streams after it received rank 0's state."""

    restore_from: Path | None = None
    """The checkpoint file that :meth:`load_state` is about to read (the driver sets it first): the
    parts of a checkpoint written in parts (:class:`PartedState`) lie beside it."""


class PartedState(abc.ABC):
    """An engine whose checkpoints are written in parts by global layer index, so that they do not
    depend on how the model is split (pipeline stages): each rank that is the first copy of its
    layers writes a part, then rank 0 writes :meth:`StateIO.state_bytes` (no model in it) and the
    manifest that lists the parts (:meth:`hvdtrain.checkpoint.CheckpointManager.save`)."""

    @abc.abstractmethod
    def part_bytes(self) -> tuple[str, list[int], bytes] | None:
        """This rank's part: its label (``"stage-1"``, unique among the ranks), the global indices
        of its layers and its state serialised; None when another rank writes its layers."""


class Engine(Step, StateIO):
    """One framework's side of training: a model and optimizer on Horovod.

    ``hvdtrain.torch.engine.TorchEngine`` and ``hvdtrain.tensorflow.engine.TensorFlowEngine``
    implement it; :func:`make_engine` builds one complete (Horovod started, model, optimizer and data
    ready). Every method is called on every rank in the same order: several run collectives.
    """

    framework: str
    collectives: Collectives
    rank: int
    size: int
    local_rank: int
    local_size: int
    cycle_time_ms: str
    """Horovod's cycle time in force, as :func:`hvdtrain.horovod_start.set_cycle_time` left
    ``HOROVOD_CYCLE_TIME``."""

    @property
    def data_rank(self) -> int:
        """Which share of each global batch this rank trains on (the sampler's and evaluation's
        rank): its rank, unless pipeline stages make several ranks one data-parallel copy."""
        return self.rank

    @property
    def data_size(self) -> int:
        """The data-parallel copies the global batch is shared among: the world size, unless
        pipeline stages make several ranks one copy (then ``size / pipeline.stages``)."""
        return self.size

    @abc.abstractmethod
    def resize(self, rank: int, size: int, accumulation: int) -> None:
        """Follows a new world (elastic mode): this rank's place, the world size, and the
        micro-batches each rank accumulates before its gradients are exchanged."""

    def reshard(self) -> None:
        """Builds the model and optimizer again, cut for the world of the last :meth:`resize`
        (elastic mode with ``shard.stage`` 1-3, before the committed state is loaded into them);
        a collective. Engines that cannot re-shard refuse."""
        raise HvdtrainError(f"{self.framework}: elastic mode cannot re-shard this engine")

    def finish(self) -> None:
        """After the training's last step (or a requested stop), on every rank: ends the gradient
        exchange (parameter servers' workers tell the servers they are done). No-op here."""

    def pipeline_stages(self) -> list[int] | None:
        """The pipeline stage each rank holds, by rank; None without pipeline stages."""
        return None

    @abc.abstractmethod
    def parameters(self) -> dict[str, np.ndarray]:
        """The model's parameters by name, as NumPy arrays (for checks and tests)."""

    @abc.abstractmethod
    def versions(self) -> dict[str, str]:
        """Versions of the framework and Horovod, for the run summary."""

    def placement(self) -> dict[str, str]:
        """For the run summary: ``device`` (``cpu`` or ``cuda:<i>``) and ``collectives`` (``nccl``
        for GPU tensors where Horovod was built with it, else ``gloo`` or ``mpi``)."""
        return {"device": "cpu", "collectives": "unknown"}


def make_engine(cfg: Config, dataset: Dataset) -> Engine:
    """The configured framework's engine, built complete: Horovod started, model, optimizer and
    data ready. The framework is imported only now, so the core stays framework-free."""
    module, _, cls = engine_path(cfg).partition(":")  # the strategies' registry says which
    try:
        engine_cls = getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise HvdtrainError(f"framework={cfg.framework!r}: cannot load its engine ({exc}); "
                            "run `hvdtrain doctor`") from None
    return engine_cls(cfg, dataset)
