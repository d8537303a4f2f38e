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
from hvdtrain.layout import Layout, check_nodes, hybrid
from hvdtrain.ps.mpi import horovod_comm, ps_settings
from hvdtrain.registry import MODELS
from hvdtrain.shard_files import ShardLayout
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
from hvdtrain.torch.shard_files import (
    is_sharded,
    load_rest,
    rank0_contents,
    restore_shards,
    shard_part,
    sources,
    whole_state,
)
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
        kind = self._start(cfg, process_sets=hybrid(cfg))  # shard.group=node: a set per node
        torch.manual_seed(cfg.seed + self.rank)
        self._made = (cfg, dataset)  # elastic mode builds the model again to re-shard it
        self.device = place(kind, self.local_rank, self.local_size)
        self.model = self._placed_model(cfg, dataset)
        self.precision = Precision(cfg.train.precision, self.device, cfg.optim.clip_norm,
                                   cfg.train.loss_scale)
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
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        # The job's ranks: who holds which part (shard.group=node: a node's ranks shard a copy).
        self.layout = Layout.of(cfg, self.size, check_nodes(self.collectives.allgather_object(
            (self.local_rank, self.local_size, hvd.cross_rank()))) if hybrid(cfg) else 1)
        torch.set_num_threads(compute_threads(cfg.train.threads, self.local_size))
        return kind
    def _placed_model(self, cfg: Config, dataset: Dataset) -> torch.nn.Module:
        model = self._build(cfg, dataset)
        if cfg.model.sync_batchnorm:
            model = syncbn.convert(model, self.device)
        return model.to(self.device)  # before the optimizer, whose state then lives there too

    def _build(self, cfg: Config, dataset: Dataset) -> torch.nn.Module:
        # shard.stage=3 builds and shards one layer at a time where the adapter has layers (on
        # the CPU: moving freed parameters to a GPU afterwards is not built).
        on_cpu = resolve(cfg.train.device) == "cpu"
        model = ((cfg.shard.stage == 3 and on_cpu and build_by_units(
            self.adapter, dataset.spec(), cfg.seed, *self.layout.sharding(self.rank),
            seed_rank=self.rank)) or self.adapter.build(dataset.spec()))
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
        if self.precision.scaling:  # fp16: rank 0's restored loss scale, the same on every rank
            self.precision.load_state_dict(hvd.broadcast_object(
                self.precision.state_dict(), root_rank=0, name="hvdtrain.precision"))
        # Each rank's own residuals, re-sharded if the size changed.
        self.exchange.resize(self.rank, self.size, self.accumulation)
        if is_sharded(self.optimizer):  # from a checkpoint of shards: each rank reads its own
            restore_shards(self.optimizer, self.model, self._shard_source)
            self._shard_source = None
        self.exchange.broadcast(root_rank=0)

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        self.rank, self.size = rank, size
        self.layout = self.layout.resized(size)
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        self.accumulation = accumulation
        if not is_sharded(self.optimizer):  # a sharded one is made again by reshard()
            self.exchange.resize(rank, size, accumulation)

    def reshard(self) -> None:
        # The shards' bounds, units and hooks are cut for one world: the model and optimizer
        # are made again for this one (stage 3 one unit at a time, as at the start) and the
        # committed state is loaded into them. The random streams go on as they were.
        streams = rng.capture()
        cfg, dataset = self._made
        self.model = self._placed_model(cfg, dataset)
        self._make_optimizer(cfg)
        self.exchange.resize(self.rank, self.size, self.accumulation)
        self.model.train()
        rng.restore(streams)

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

    _shard_source: dict[str, Any] | None = None  # rank 0: a checkpoint of shards to read
    _wrote_shards = False  # every rank wrote its shards: rank 0's file holds the rest

    def shard_part(self) -> tuple[str, dict[str, Any], Any] | None:
        # shard.stage 1-3: every rank writes its own shards (hvdtrain/torch/shard_files.py).
        self._wrote_shards = is_sharded(self.optimizer)
        return shard_part(self.optimizer, self.model, self.rank) if self._wrote_shards else None

    def state_bytes(self, meta: dict[str, Any]) -> bytes:
        buffer = io.BytesIO()
        wrote, self._wrote_shards = self._wrote_shards, False
        contents = (rank0_contents(self.optimizer, self.model) if wrote else
                    {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()})
        torch.save({**contents, "rng": rng.capture(), "precision": self.precision.state_dict(),
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
        if parts and "shards" not in state and self.restore_from is not None:  # pipeline stages'
            names = [name for name, _ in self.model.named_parameters()]
            model, optimizer, compression = merged_parts(self.restore_from.parent, parts, names,
                                                         where)
            trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
            state = {**state, "model": model, "optimizer": optimizer,
                     "compression": by_index(compression, trainable)}
        source = sources(state, self.restore_from, where)
        if source is not None and not is_sharded(self.optimizer):  # the ring: whole tensors
            model, optimizer = whole_state(source, self.model)
            state, source = {**state, "model": model, "optimizer": optimizer}, None
        try:
            if source is not None:  # every rank reads its shards in broadcast_state
                load_rest(self.model, state["model"], ShardLayout.from_dict(
                    source["layout"], where), where)
                self._shard_source = {k: v for k, v in source.items() if k != "model"}
            else:
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
