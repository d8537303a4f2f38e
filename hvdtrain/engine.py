"""The Engine: what the framework-free loop needs from a framework.

``hvdtrain.torch.engine.TorchEngine`` and ``hvdtrain.tensorflow.engine.TensorFlowEngine`` implement it.
Every method is called on every rank in the same order, because several of them run collectives.
"""

from __future__ import annotations

import abc
import importlib
from pathlib import Path
from typing import IO, Any, Callable, Iterable

import numpy as np

from hvdtrain.config import Config
from hvdtrain.data import Dataset, StepIndices
from hvdtrain.errors import HvdtrainError


class Engine(abc.ABC):
    """One framework's side of training: model, optimizer, Horovod collectives and checkpoints."""

    framework: str
    rank: int
    size: int
    local_rank: int
    local_size: int

    @abc.abstractmethod
    def prepare(self, cfg: Config, dataset: Dataset) -> None:
        """Builds model and optimizer and loads the data (no communication)."""

    @abc.abstractmethod
    def broadcast_state(self) -> None:
        """Gives every rank rank 0's model and optimizer state (initial or restored)."""

    @abc.abstractmethod
    def train_step(self, step: StepIndices, lr: float) -> dict[str, float]:
        """Runs one optimizer step; returns this rank's sums (``loss``, ``count``, metrics)."""

    def step_stats(self) -> dict[str, float]:
        """Measurements of this rank's last :meth:`train_step` (empty when an engine has none).

        ``data_s``: gathering the batch; ``compute_s``: forward, backward, update and compression
        kernels; ``comm_s``: time spent waiting for the gradient exchange's Horovod collectives;
        ``wire_bytes``: bytes of the tensors handed to Horovod for that exchange, counted from the
        tensors sent; ``dense_bytes``: bytes of the dense gradients they stand for.
        """
        return {}

    @abc.abstractmethod
    def evaluate(self, batches: Iterable[np.ndarray]) -> dict[str, float]:
        """Scores the test samples of these index batches; returns this rank's sums."""

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
    def write_checkpoint(self, fileobj: IO[bytes], meta: dict[str, Any]) -> None:
        """Serialises model, optimizer and ``meta`` into an open binary file."""

    def gather_checkpoint_state(self) -> None:
        """Called on every rank just before rank 0 writes a checkpoint: collects the state that
        differs between ranks (error-feedback residuals) onto rank 0. A collective; no-op here."""

    @abc.abstractmethod
    def read_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restores model and optimizer from a checkpoint file; returns its ``meta``."""

    @abc.abstractmethod
    def parameters(self) -> dict[str, np.ndarray]:
        """The model's parameters by name, as NumPy arrays (for checks and tests)."""

    @abc.abstractmethod
    def versions(self) -> dict[str, str]:
        """Versions of the framework and Horovod, for the run summary."""


def add_batch_sums(sums: dict[str, float], loss_sum: Any, metrics: dict[str, Any], count: int) -> None:
    """Adds one batch's summed loss and metrics (framework scalars) and its size to ``sums``."""
    sums["loss"] += float(loss_sum)
    sums["count"] += count
    for key, value in metrics.items():
        sums[key] = sums.get(key, 0.0) + float(value)


def make_engine(framework: str) -> Engine:
    """Imports the framework's engine (only now, so the core stays framework-free) and starts it."""
    module, cls = {"torch": ("hvdtrain.torch.engine", "TorchEngine"),
                   "tensorflow": ("hvdtrain.tensorflow.engine", "TensorFlowEngine")}[framework]
    try:
        engine_cls = getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise HvdtrainError(f"framework={framework!r}: cannot load its engine ({exc}); "
                            "run `hvdtrain doctor`") from None
    return engine_cls()
