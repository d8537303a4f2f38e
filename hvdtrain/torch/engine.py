"""The PyTorch engine: Horovod's DistributedOptimizer driven by the framework-free loop."""

from __future__ import annotations

import io
import pickle
import time
import warnings
from typing import Any, Iterable

import horovod
import horovod.torch as hvd
import numpy as np
import torch

from hvdtrain.adapters import ModelAdapter, make_adapter
from hvdtrain.checkpoint import not_a_checkpoint
from hvdtrain.config import Config
from hvdtrain.data.contracts import Dataset
from hvdtrain.data.loading import loader_workers
from hvdtrain.data.sampler import StepIndices
from hvdtrain.data.tree import leading_size
from hvdtrain.engine import Engine, add_batch_sums, compute_threads, start_horovod
from hvdtrain.errors import HvdtrainError
from hvdtrain.registry import MODELS
from hvdtrain.torch import rng, syncbn
from hvdtrain.torch.collectives import TorchCollectives
from hvdtrain.torch.compression import (GradientExchange, bytes_per_step, horovod_compression,
                                        make_exchange, to_torch)
from hvdtrain.torch.device import place, resolve, summary
from hvdtrain.torch.data import TorchLoader
from hvdtrain.torch.models import ClassifierAdapter
from hvdtrain.torch.precision import PlacedAdapter, Precision


def make_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The configured optimizer; its learning rate is set by the loop before every step."""
    o = cfg.optim
    if o.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum,
                               weight_decay=o.weight_decay)
    cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    return cls(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)


class TorchEngine(Engine):
    """Trains a ``torch.nn.Module`` on Horovod; see :class:`hvdtrain.engine.Engine`."""

    framework = "torch"

    def __init__(self, cfg: Config, dataset: Dataset) -> None:
        self.seed = cfg.seed
        self.collectives = TorchCollectives()
        self.adapter: ModelAdapter = make_adapter(MODELS["torch"].get(cfg.model.name),
                                                  cfg.model.options, cfg.model.name, ClassifierAdapter)
        kind = resolve(cfg.train.device)  # before Horovod starts: a wrong train.device stops here
        self.cycle_time_ms = start_horovod(hvd, cfg.comm.cycle_time_ms)
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        torch.set_num_threads(compute_threads(cfg.train.threads, self.local_size))
        torch.manual_seed(cfg.seed + self.rank)
        self.model = self._build(cfg, dataset)
        self.device = place(kind, self.local_rank, self.local_size)
        if cfg.model.sync_batchnorm:
            self.model = syncbn.convert(self.model, self.device)
        self.model.to(self.device)  # before the optimizer, whose state then lives there too
        self.precision = Precision(cfg.train.precision, self.device)
        self.adapter = PlacedAdapter(self.adapter, self.device, self.precision)
        self.data = TorchLoader(dataset.train(), dataset.test(), seed=cfg.seed, rank=self.rank,
                                workers=loader_workers(cfg.data.workers, self.local_size),
                                prefetch=cfg.data.prefetch, device=self.device)
        self._make_optimizer(cfg)
        self.model.train()  # evaluate() switches to eval mode and back
        self.lr = float("nan")  # the loop sets the real one before the first step

    def _build(self, cfg: Config, dataset: Dataset) -> torch.nn.Module:
        model = self.adapter.build(dataset.spec())
        if not isinstance(model, torch.nn.Module):
            raise HvdtrainError(f"model {cfg.model.name!r}: build() must return a torch.nn.Module")
        return model

    def _make_optimizer(self, cfg: Config) -> None:
        optimizer = make_optimizer(cfg, self.model)
        self.exchange: GradientExchange | None = None
        self._stats: dict[str, float] = {}
        compression = horovod_compression(cfg.comm.compression)
        if compression is not None:
            # Horovod's own path: allreduce starts in backward hooks, overlapping computation.
            self.optimizer = hvd.DistributedOptimizer(
                optimizer, named_parameters=self.model.named_parameters(),
                compression=compression,
                backward_passes_per_step=cfg.train.backward_passes_per_step)
            # The parameters it allreduces every step: none at one rank outside elastic mode, where
            # Horovod registers no hooks.
            self.step_bytes = bytes_per_step(compression, self.optimizer._requires_update)
        else:
            # hvdtrain's exchange runs once per step after the micro-batches' gradients accumulated.
            self.optimizer = optimizer
            self.exchange = make_exchange(cfg.comm, cfg.seed, self.rank, self.size,
                                          [p.shape for p in self.model.parameters()])

    def broadcast_state(self) -> None:
        # Optimizer state first: on a rank without state Horovod makes it with a zero-gradient step,
        # which weight decay would turn into a change of the weights that the broadcast then undoes.
        hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.exchange is not None:  # each rank's own residuals, re-sharded if the size changed
            self.exchange.resize(self.rank, self.size)
            self.exchange.broadcast(root_rank=0)

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        if self.exchange is not None:
            self.exchange.resize(rank, size)
        elif self.optimizer.backward_passes_per_step != accumulation:
            self.optimizer.set_backward_passes_per_step(accumulation)

    def fork_rng(self, seed: int, step: int) -> None:
        rng.fork(seed, self.rank, step)

    def train_step(self, step: StepIndices, lr: float) -> dict[str, float]:
        if lr != self.lr:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.lr = lr
        start = time.perf_counter()
        self.optimizer.zero_grad()
        # Horovod averages over ranks; weighting each rank's summed loss by size / global_count makes
        # the result the mean over the step's samples, even when ranks hold unequal shares.
        scale = self.size / step.global_count
        sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
        data_s = 0.0  # the wait for each micro-batch: what prefetching did not hide
        batches = self.data.batches(step)
        for idx in step.micro:
            waited = time.perf_counter()
            x, y = next(batches)
            data_s += time.perf_counter() - waited
            loss_sum, metrics = self.adapter.loss_and_metrics(self.model, x, y)
            self.precision.backward(loss_sum, scale)
            add_batch_sums(sums, loss_sum.detach(), metrics, len(idx))
        stats = self._exchange_and_step()
        stats["data_s"] = data_s
        stats["compute_s"] = time.perf_counter() - start - data_s - stats["comm_s"]
        self._stats = stats
        return sums

    def _exchange_and_step(self) -> dict[str, float]:
        """Averages the gradients over ranks, steps the optimizer, and returns what it measured."""
        if self.exchange is not None:
            params = list(self.model.parameters())
            for p in params:
                if p.grad is None:  # a parameter this step did not reach still takes part
                    p.grad = torch.zeros_like(p)
            if not self.precision.step_exchange(self.optimizer, params, self.exchange.run):
                return {"wire_bytes": 0.0, "dense_bytes": 0.0, "comm_s": 0.0, "skipped": 1.0}
            return {**{k: self.exchange.stats[k]
                       for k in ("wire_bytes", "dense_bytes", "comm_s", "compress_s")},
                    "skipped": float(self.precision.skipped)}
        comm_s = self.precision.step_horovod(self.optimizer)
        wire, dense = self.step_bytes
        return {"wire_bytes": float(wire), "dense_bytes": float(dense), "comm_s": comm_s,
                "skipped": float(self.precision.skipped)}

    def step_stats(self) -> dict[str, float]:
        return dict(self._stats)

    @torch.no_grad()
    def evaluate(self, batches: Iterable[np.ndarray]) -> dict[str, float]:
        self.model.eval()
        sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
        for x, y in self.data.eval_batches(batches):
            loss_sum, metrics = self.adapter.loss_and_metrics(self.model, x, y, training=False)
            add_batch_sums(sums, loss_sum.detach(), metrics, leading_size(x))
        self.model.train()
        return sums

    def state_bytes(self, meta: dict[str, Any]) -> bytes:
        buffer = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "rng": rng.capture(), "precision": self.precision.state_dict(),
                    "compression": to_torch(self.exchange.state_dict()) if self.exchange else None,
                    "meta": meta}, buffer)
        return buffer.getvalue()

    def gather_state(self) -> None:
        # Residuals differ per rank: rank 0 collects them all so that resuming restores each one.
        if self.exchange is not None:
            self.exchange.gather()

    def load_state(self, data: bytes, where: str) -> dict[str, Any]:
        # weights_only: loading a checkpoint must never execute code from the file.
        try:
            with warnings.catch_warnings():  # a foreign file's pickle protocol: the error says it
                warnings.simplefilter("ignore")
                state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:  # objects other than tensors: refused, never built
            raise not_a_checkpoint(where, "not a PyTorch file of tensors; nothing in it was run") from None
        except Exception as exc:  # whatever the file holds, the user gets one line naming it
            raise not_a_checkpoint(where, exc) from None
        if not (isinstance(state, dict) and {"model", "optimizer", "meta"} <= state.keys()
                and isinstance(state["meta"], dict)):
            raise not_a_checkpoint(where, "no model, optimizer and meta entries")
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.precision.load_state_dict(state.get("precision"))
            if self.exchange is not None:
                self.exchange.load_state_dict(state.get("compression"), where)
            if "rng" in state:  # absent in checkpoints written before random states were saved
                rng.restore(state["rng"])
        except HvdtrainError:
            raise
        except Exception as exc:  # entries of the wrong shape, or not what torch wrote
            first = str(exc).strip().splitlines() or [type(exc).__name__]
            raise HvdtrainError(f"{where} does not fit the model: "
                                f"{' '.join(line.strip() for line in first[:3])}") from None
        return state["meta"]

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: p.detach().cpu().numpy().copy() for name, p in self.model.named_parameters()}

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "horovod": horovod.__version__}

    def placement(self) -> dict[str, str]:
        return summary(self.device)
