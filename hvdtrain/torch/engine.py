"""The PyTorch engine: a model, its optimizer and loader on Horovod, driven by the framework-free
loop; a step is :func:`hvdtrain.step.train_step` over :class:`hvdtrain.torch.step.TorchKernels`
and the run's gradient exchange (:mod:`hvdtrain.torch.exchange`)."""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

import horovod
import horovod.torch as hvd
import numpy as np
import torch

from hvdtrain.adapters import ModelAdapter, make_adapter
from hvdtrain.compression.state import by_index
from hvdtrain.config import Config, OptimConfig
from hvdtrain.data.contracts import Dataset
from hvdtrain.data.loading import loader_workers
from hvdtrain.data.sampler import StepIndices
from hvdtrain.data.tree import leading_size
from hvdtrain.engine import Engine
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import ExchangeRequest
from hvdtrain.horovod_start import compute_threads, start_horovod
from hvdtrain.layout import Layout
from hvdtrain.ps.mpi import horovod_comm, ps_settings
from hvdtrain.registry import MODELS
from hvdtrain.step import add_batch_sums, train_step
from hvdtrain.torch import rng, syncbn
from hvdtrain.torch.collectives import TorchCollectives
from hvdtrain.torch.compression import to_torch
from hvdtrain.torch.data import TorchLoader
from hvdtrain.torch.device import place, resolve, summary
from hvdtrain.torch.exchange import make_exchange
from hvdtrain.torch.models import ClassifierAdapter
from hvdtrain.torch.parts import merged_parts, read_state
from hvdtrain.torch.precision import PlacedAdapter, Precision
from hvdtrain.torch.shard import ShardedOptimizer
from hvdtrain.torch.shard_units import UnitShardedOptimizer, build_by_units, checkpoint_units
from hvdtrain.torch.step import TorchKernels


def make_optimizer(o: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The configured optimizer; its learning rate is set by the loop before every step."""
    if o.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum,
                               weight_decay=o.weight_decay)
    cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    return cls(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)


class TorchEngine(Engine):
    """Trains a ``torch.nn.Module`` on Horovod; see :class:`hvdtrain.engine.Engine`."""

    framework = "torch"
    collectives: TorchCollectives
    adapter: ModelAdapter

    def __init__(self, cfg: Config, dataset: Dataset) -> None:
        kind = self._start(cfg)
        torch.manual_seed(cfg.seed + self.rank)
        self.model = self._build(cfg, dataset)
        self.device = place(kind, self.local_rank, self.local_size)
        if cfg.model.sync_batchnorm:
            self.model = syncbn.convert(self.model, self.device)
        self.model.to(self.device)  # before the optimizer, whose state then lives there too
        self.precision = Precision(cfg.train.precision, self.device, cfg.optim.clip_norm)
        self.adapter = PlacedAdapter(self.adapter, self.device, self.precision)
        self.data = TorchLoader(dataset.train(), dataset.test(), seed=cfg.seed, rank=self.rank,
                                workers=loader_workers(cfg.data.workers, self.local_size),
                                prefetch=cfg.data.prefetch, device=self.device)
        self.accumulation = cfg.train.backward_passes_per_step
        self._make_optimizer(cfg)
        self.model.train()  # evaluate() switches to eval mode and back

    def _start(self, cfg: Config, process_sets: bool = False) -> str:
        """The adapter, Horovod and the compute threads: what every torch engine sets up before
        its model (the pipeline's too, with ``process_sets``). Returns the device kind."""
        self.seed = cfg.seed
        self.collectives = TorchCollectives()
        self.adapter = make_adapter(
            MODELS["torch"].get(cfg.model.name), cfg.model.options, cfg.model.name,
            ClassifierAdapter)
        kind = resolve(cfg.train.device)  # before Horovod starts: a wrong train.device stops here
        self.cycle_time_ms = start_horovod(hvd, cfg.comm.cycle_time_ms, process_sets=process_sets,
                                           comm=horovod_comm(cfg))
        self.rank, self.size = hvd.rank(), hvd.size()
        self.layout = Layout.of(cfg, self.size)  # the job's ranks: who holds which part
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        torch.set_num_threads(compute_threads(cfg.train.threads, self.local_size))
        return kind
    def _build(self, cfg: Config, dataset: Dataset) -> torch.nn.Module:
        # shard.stage=3 builds and shards one layer at a time where the adapter has layers (on
        # the CPU: moving freed parameters to a GPU afterwards is not built).
        on_cpu = resolve(cfg.train.device) == "cpu"
        model = ((cfg.shard.stage == 3 and on_cpu and build_by_units(
            self.adapter, dataset.spec(), cfg.seed, self.layout.copy_of(self.rank),
            self.layout.copies)) or self.adapter.build(dataset.spec()))
        if not isinstance(model, torch.nn.Module):
            raise HvdtrainError(f"model {cfg.model.name!r}: build() must return a torch.nn.Module")
        if cfg.model.activation_checkpointing:  # per unit, the units sharding cuts
            checkpoint_units(model, cfg.shard.unit_kib * 1024)
        return model

    def _make_optimizer(self, cfg: Config) -> None:
        self.exchange, self.optimizer = make_exchange(cfg, ExchangeRequest(
            cfg.comm, cfg.seed, self.rank, self.size,
            [p for p in self.model.parameters() if p.requires_grad],
            optimizer=make_optimizer(cfg.optim, self.model), model=self.model,
            accumulation=cfg.train.backward_passes_per_step, ps=ps_settings(cfg),
            shard=cfg.shard, layout=self.layout))
        self.precision.attach(self.optimizer)
        self.kernels = TorchKernels(self.model, self.optimizer, self.adapter, self.data,
                                    self.precision)
        self._stats: dict[str, float] = {}

    def broadcast_state(self) -> None:
        # Optimizer state first: on a rank without state Horovod makes it with a zero-gradient step,
        # which weight decay would turn into a change of the weights that the broadcast then undoes.
        # A sharded optimizer's ranks hold different shards: its exchange's broadcast cuts them.
        if not isinstance(self.optimizer, ShardedOptimizer | UnitShardedOptimizer):
            hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        # Each rank's own residuals, re-sharded if the size changed.
        self.exchange.resize(self.rank, self.size, self.accumulation)
        self.exchange.broadcast(root_rank=0)

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        self.rank, self.size = rank, size
        self.layout = self.layout.resized(size)
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        self.accumulation = accumulation
        self.exchange.resize(rank, size, accumulation)

    def finish(self) -> None:
        self.exchange.finish()

    def fork_rng(self, seed: int, step: int) -> None:
        rng.fork(seed, self.rank, step)

    def train_step(self, step: StepIndices, lr: float) -> dict[str, float]:
        result = train_step(self.kernels, self.exchange, step, lr, self.size)
        self._stats = result.stats
        return result.sums

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
                    "compression": (to_torch(entry) if (entry := self.exchange.state_dict())
                                    else None),
                    "meta": meta}, buffer)
        return buffer.getvalue()

    def gather_state(self) -> None:
        # Residuals differ per rank: rank 0 collects them all so that resuming restores each one.
        self.exchange.gather()

    def load_state(self, data: bytes, where: str) -> dict[str, Any]:
        state = read_state(data, where)
        parts = state["meta"].get("parts")
        if parts and self.restore_from is not None:  # written by pipeline stages: merge them all
            names = [name for name, _ in self.model.named_parameters()]
            model, optimizer, compression = merged_parts(self.restore_from.parent, parts, names,
                                                         where)
            trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
            state = {**state, "model": model, "optimizer": optimizer,
                     "compression": by_index(compression, trainable)}
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.precision.load_state_dict(state.get("precision"))
            self.exchange.load_state_dict(state.get("compression"), where)
            if "rng" in state:  # absent in checkpoints written before random states were saved
                rng.restore(state["rng"])
        except HvdtrainError:
            raise
        except Exception as exc:  # noqa: BLE001  (entries of the wrong shape, or not torch's)
            first = str(exc).strip().splitlines() or [type(exc).__name__]
            raise HvdtrainError(f"{where} does not fit the model: "
                                f"{' '.join(line.strip() for line in first[:3])}") from None
        return state["meta"]

    def parameters(self) -> dict[str, np.ndarray]:
        if isinstance(self.optimizer, UnitShardedOptimizer):  # stage 3: gathered (a collective)
            self.optimizer.sharding.gather_all(keep=True)
        return {name: p.detach().cpu().numpy().copy() for name, p in self.model.named_parameters()}

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "horovod": horovod.__version__}

    def placement(self) -> dict[str, str]:
        return summary(self.device)
