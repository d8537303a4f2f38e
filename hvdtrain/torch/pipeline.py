"""PyTorch pipeline stages composed with Horovod data parallelism (``pipeline.stages`` > 1).

Each rank builds only its own pieces of the model from the adapter's layer factories
(:meth:`hvdtrain.adapters.ModelAdapter.layers`), cut by :mod:`hvdtrain.pipeline.split` and placed
by :class:`hvdtrain.pipeline.layout.Layout` and the schedule. ``torch.distributed.pipelining``
carries activations and their gradients between the stages of one pipeline copy over a torch
process group of that copy's ranks (Gloo on CPU, NCCL on GPU); its rendezvous address is chosen by
rank 0 and handed out by Horovod. Each stage's gradients are averaged over that stage's copies by
Horovod in a process set (:class:`StageAllreduce`, the run's gradient exchange), once per step
after the last micro-batch, so :func:`hvdtrain.step.train_step` runs a pipeline step as it runs
any other: one "micro-batch" per step whose backward pass is the whole schedule.

Shapes never change between steps: a copy's batch is padded to ``data.batch_size`` by repeating
its samples, and the padded rows are left out of the loss and metrics (weight zero).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from hvdtrain.adapters import ModelAdapter, make_adapter
from hvdtrain.config import Config
from hvdtrain.data import tree
from hvdtrain.data.contracts import Dataset, DatasetSpec
from hvdtrain.data.loading import loader_workers
from hvdtrain.data.sampler import StepIndices
from hvdtrain.driver import launcher_host
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import GradientExchange, empty_stats
from hvdtrain.horovod_start import compute_threads, start_horovod
from hvdtrain.pipeline import SCHEDULES, Layout, Schedule, layer_names, stage_bounds
from hvdtrain.pipeline.schedules import microbatch_count
from hvdtrain.registry import MODELS
from hvdtrain.step import StepKernels, add_batch_sums, train_step
from hvdtrain.torch.collectives import TorchCollectives
from hvdtrain.torch.data import TorchLoader
from hvdtrain.torch.device import place, resolve
from hvdtrain.torch.engine import TorchEngine, make_optimizer
from hvdtrain.torch.exchange import horovod_compression
from hvdtrain.torch.models import ClassifierAdapter
from hvdtrain.torch.precision import Precision

_PROCESS_SETS: dict[tuple[int, ...], Any] = {}
"""Horovod process sets by their ranks: made once per process (a second training in the same
process reuses them; Horovod refuses a duplicate)."""


def stage_process_set(ranks: Sequence[int]) -> Any:
    """Horovod's process set of ``ranks``; every rank must ask for every set in the same order."""
    key = tuple(ranks)
    if key not in _PROCESS_SETS:
        _PROCESS_SETS[key] = hvd.add_process_set(list(key))
    return _PROCESS_SETS[key]


def rendezvous_address(collectives: TorchCollectives) -> str:
    """Rank 0's address as the other ranks can reach it: the loopback where every rank shares
    its host, else the address of rank 0's route towards another rank's host (``gethostbyname``
    of the own host name may give 127.0.x.1, which no other host reaches). A collective."""
    hosts = collectives.allgather_object(launcher_host(os.environ))
    if collectives.rank() != 0:
        return ""
    others = [h for h in hosts if h != hosts[0]]
    if not others:
        return "127.0.0.1"
    try:
        peer = socket.gethostbyname(others[0])
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((peer, 9))  # UDP: no packet is sent; the kernel picks the route
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise HvdtrainError(f"pipeline stages: cannot find rank 0's address towards host "
                            f"{others[0]!r} ({exc})") from None


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def start_torch_distributed(collectives: TorchCollectives, device: torch.device,
                            timeout_s: float) -> None:
    """Starts ``torch.distributed`` over every rank (ranks as Horovod's), at an address rank 0
    chose and Horovod's broadcast handed out; once per process. ``timeout_s`` bounds a wait for
    another stage, so a lost rank ends the job instead of hanging it (0: torch's default)."""
    if dist.is_initialized():
        return
    address = rendezvous_address(collectives)
    if collectives.rank() == 0:
        address = f"tcp://{address}:{free_port()}"
    address = collectives.broadcast_object(address)
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s > 0 else None
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=address,
                            rank=collectives.rank(), world_size=collectives.size(),
                            timeout=timeout)


def pipeline_groups(layout: Layout, rank: int) -> Any:
    """This rank's pipeline process group (every rank creates every copy's, in order)."""
    mine = None
    for ranks in layout.pipelines():
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def layer_costs(factories: Sequence[Any]) -> list[int]:
    """Parameters per layer, each built on the meta device (no memory, no random numbers)."""
    costs = []
    for make in factories:
        with torch.device("meta"):
            layer = make()
        costs.append(sum(p.numel() for p in layer.parameters()))
        del layer
    return costs


def build_pieces(factories: Sequence[Any], bounds: Sequence[int], mine: Sequence[int],
                 seed: int) -> dict[int, nn.Sequential]:
    """This rank's pieces, each an ``nn.Sequential`` whose children are named by their global
    layer index (so a piece's ``state_dict`` keys are the whole ``Sequential``'s).

    Every layer is made in order under ``seed``, as the whole model would be, and the other
    pieces' layers dropped at once: the rank's layers start from the whole model's values,
    whatever the split, and no other layer outlives its own construction.
    """
    torch.manual_seed(seed)
    owner = {i: piece for piece in mine for i in range(bounds[piece], bounds[piece + 1])}
    layers: dict[int, list[tuple[str, nn.Module]]] = {piece: [] for piece in mine}
    for index, make in enumerate(factories):
        layer = make()
        if index in owner:
            if not isinstance(layer, nn.Module):
                raise HvdtrainError(f"layer {index} of the model is a {type(layer).__name__}, "
                                    "not a torch.nn.Module")
            layers[owner[index]].append((str(index), layer))
        del layer
    return {piece: nn.Sequential(OrderedDict(named)) for piece, named in layers.items()}


def pad_rows(batch: Any, rows: int) -> Any:
    """``batch`` (a tree of tensors) with ``rows`` rows: its own rows repeated in order, or zeros
    where it has none; fixed shapes for the pipeline."""
    def pad(t: torch.Tensor) -> torch.Tensor:
        have = t.shape[0]
        if have == rows:
            return t
        if have == 0:
            return t.new_zeros((rows, *t.shape[1:]))
        return t[torch.arange(rows, device=t.device) % have]
    return tree.map_tree(pad, batch)


class StageAllreduce(GradientExchange):
    """A pipeline stage's gradient exchange: Horovod's average over that stage's copies, in
    their process set (nothing to send with one copy). ``comm.compression`` ``fp16`` applies."""

    def __init__(self, process_set: Any, rank: int, size: int, method: str) -> None:
        self.process_set, self.rank, self.size = process_set, rank, size
        self.compression = horovod_compression(method)
        self.stats = empty_stats()

    def run(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.process_set is None:
            self.stats = empty_stats()
            return list(grads)
        waited = time.perf_counter()
        averaged = hvd.grouped_allreduce(list(grads), op=hvd.Average, name="hvdtrain.stage",
                                         compression=self.compression,
                                         process_set=self.process_set)
        dense = float(sum(g.numel() * g.element_size() for g in grads))
        wire = dense / 2 if self.compression is hvd.Compression.fp16 else dense
        self.stats = {"wire_bytes": wire, "dense_bytes": dense,
                      "comm_s": time.perf_counter() - waited, "compress_s": 0.0}
        return list(averaged)

    def any_rank(self, flag: bool) -> bool:
        if self.process_set is None:
            return flag
        total = hvd.allreduce(torch.tensor([float(flag)]), op=hvd.Sum, name="hvdtrain.stage_any",
                              process_set=self.process_set)
        return float(total) > 0

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        raise HvdtrainError("pipeline stages do not resize (elastic mode is refused with them)")


class Runner:
    """One ``torch.distributed.pipelining`` schedule over this rank's pieces for batches of
    ``rows`` rows: train and evaluation each have one (receive buffers keep their first shape)."""

    def __init__(self, engine: PipelineEngine, rows: int) -> None:
        self.engine, self.rows = engine, rows
        plan = engine.schedule
        stages = [PipelineStage(module, piece, engine.pieces, engine.device, group=engine.group)
                  for piece, module in sorted(engine.modules.items())]
        cls = getattr(torch_schedules, plan.torch_class)
        single = plan.virtual == (1, 1)
        self.schedule = cls(stages[0] if single else stages, engine.microbatches,
                            loss_fn=self._loss, scale_grads=False)
        self.sums: dict[str, float] = {}
        self.y: Any = None
        self.real, self.weight, self.training = 0, 0.0, True

    def run(self, x: Any, y: Any, real: int, weight: float, training: bool) -> dict[str, float]:
        """Runs the schedule over one padded batch (``x`` on the first stage, ``y`` on the last,
        None elsewhere) whose first ``real`` rows count; returns the loss and metric sums (the
        last stage's; empty elsewhere)."""
        self.y, self.real, self.weight, self.training = y, real, weight, training
        self.sums = {"loss": 0.0, "count": 0.0} if self.engine.last else {}
        args = (x,) if self.engine.first else ()
        target = torch.arange(self.rows, device=self.engine.device) if self.engine.last else None
        if training:
            self.schedule.step(*args, target=target, return_outputs=False)
        else:
            self.schedule.eval(*args, target=target, return_outputs=False)
        sums, self.y = self.sums, None
        return sums

    def _loss(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch (``rows``: its rows' places in the batch):
        the adapter's summed loss over its real rows, times the step's weight."""
        keep = rows < self.real
        y = tree.map_tree(lambda t: t[rows[keep]], self.y)
        loss_sum, metrics = self.engine.adapter.output_loss(output[keep], y, self.training)
        add_batch_sums(self.sums, loss_sum.detach(), metrics, int(keep.sum()))
        return loss_sum * self.weight


class PipelineKernels(StepKernels):
    """The step kernels of a pipeline stage: one batch a step, whose backward pass is the whole
    schedule over the micro-batches; see :func:`hvdtrain.step.train_step`."""

    def __init__(self, engine: PipelineEngine) -> None:
        self.engine = engine
        self.precision = engine.precision
        self.params = [p for m in engine.modules.values() for p in m.parameters()
                       if p.requires_grad]
        self.lr = float("nan")

    def set_lr(self, lr: float) -> None:
        if lr != self.lr:
            for group in self.engine.optimizer.param_groups:
                group["lr"] = lr
            self.lr = lr

    def batches(self, step: StepIndices) -> Iterator[Any]:
        if not self.engine.loads_data:
            return iter([(None, None, 0)] * len(step.micro))
        return (self.engine.padded(batch, self.engine.batch_rows)
                for batch in self.engine.data.batches(step))

    def begin(self) -> None:
        self.engine.optimizer.zero_grad()

    def backward(self, batch: Any, weight: float, last: bool) -> tuple[Any, dict[str, Any]]:
        x, y, real = batch
        sums = self.engine.train_runner.run(x, y, real, weight, training=True)
        self.engine.last_sums = sums
        return sums.get("loss", 0.0), {k: v for k, v in sums.items() if k not in ("loss", "count")}

    def gradients(self) -> list[torch.Tensor]:
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        return grads


class PipelineEngine(TorchEngine):
    """A :class:`~hvdtrain.torch.engine.TorchEngine` whose rank holds one stage of one pipeline
    copy; see the module docstring. ``data_rank``/``data_size`` are the copy and the copies."""

    def __init__(self, cfg: Config, dataset: Dataset) -> None:
        self.seed = cfg.seed
        self.collectives = TorchCollectives()
        self.adapter: ModelAdapter = make_adapter(
            MODELS["torch"].get(cfg.model.name), cfg.model.options, cfg.model.name,
            ClassifierAdapter)
        kind = resolve(cfg.train.device)
        self.cycle_time_ms = start_horovod(hvd, cfg.comm.cycle_time_ms, process_sets=True)
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        self._place(cfg)
        torch.set_num_threads(compute_threads(cfg.train.threads, self.local_size))
        self.device = place(kind, self.local_rank, self.local_size)
        start_torch_distributed(self.collectives, self.device, cfg.train.stall_timeout_s)
        self.group = pipeline_groups(self.layout, self.rank)
        stage_sets = [stage_process_set(r) if self.layout.copies > 1 else None
                      for r in self.layout.stage_groups()]
        self.modules = self._build_pieces(cfg, dataset.spec())
        torch.manual_seed(cfg.seed + self.rank)
        for module in self.modules.values():
            module.to(self.device)
        self.model = nn.ModuleDict({str(k): m for k, m in self.modules.items()})
        self.precision = Precision(cfg.train.precision, self.device)
        self.data = TorchLoader(dataset.train(), dataset.test(), seed=cfg.seed,
                                rank=self.data_rank,
                                workers=loader_workers(cfg.data.workers, self.local_size),
                                prefetch=cfg.data.prefetch, device=self.device)
        self.accumulation = 1
        self.optimizer = make_optimizer(cfg.optim, self.model)
        self.stage_set = stage_sets[self.stage]
        self.exchange = StageAllreduce(self.stage_set, self.copy, self.layout.copies,
                                       cfg.comm.compression)
        self.precision.attach(self.optimizer)
        self.stage_kernels = PipelineKernels(self)
        self.batch_rows, self.eval_rows = cfg.data.batch_size, cfg.data.eval_batch_size
        self.train_runner = Runner(self, self.batch_rows)
        self._eval_runner: Runner | None = None
        self.last_sums: dict[str, float] = {}
        self._metric_keys: list[str] | None = None
        self._stats: dict[str, float] = {}
        self.model.train()

    def _place(self, cfg: Config) -> None:
        """Where this rank stands: its stage and copy, its pieces, who reads the data."""
        pipe = cfg.pipeline
        self.layout = Layout(self.size, pipe.stages)
        self.stage, self.copy = self.layout.stage_of(self.rank), self.layout.copy_of(self.rank)
        self.schedule: Schedule = SCHEDULES[pipe.schedule]
        self.pieces = pipe.stages * pipe.virtual_stages
        self.microbatches = microbatch_count(pipe.stages, pipe.microbatches, pipe.virtual_stages)
        self.mine = self.schedule.pieces_of(self.stage, pipe.stages, pipe.virtual_stages)
        self.first = 0 in self.mine
        self.last = self.pieces - 1 in self.mine
        self.loads_data = self.first or self.last
        self.last_stage = self.schedule.holder(self.pieces - 1, pipe.stages)

    def _build_pieces(self, cfg: Config, spec: DatasetSpec) -> dict[int, nn.Sequential]:
        torch.manual_seed(cfg.seed)  # the whole model's seed (rank 0's), before layers() runs
        factories = self.adapter.layers(spec)
        if factories is None:
            raise HvdtrainError(f"model {cfg.model.name!r} cannot be split into pipeline stages: "
                                "its adapter's layers() gives no layer list (see "
                                "docs/pipeline.md#your-model-as-layers)")
        names = layer_names(factories)
        self.bounds = stage_bounds(cfg.pipeline.split, layer_costs(factories), names, self.pieces)
        return build_pieces(factories, self.bounds, self.mine, cfg.seed)

    @property
    def data_rank(self) -> int:
        return self.copy

    @property
    def data_size(self) -> int:
        return self.layout.copies

    def padded(self, batch: Any, rows: int) -> tuple[Any, Any, int]:
        """A loaded ``(x, y)`` padded to ``rows`` rows, with its count of real rows."""
        x, y = batch
        real = tree.leading_size(x)
        return pad_rows(x, rows), (pad_rows(y, rows) if y is not None else None), real

    def broadcast_state(self) -> None:
        """Each stage's copies take the state of copy 0's rank of that stage."""
        if self.stage_set is None:
            return
        root = self.layout.rank_of(self.stage, 0)
        for name, tensor in sorted(self.model.state_dict().items()):
            hvd.broadcast_(tensor, root, name=f"hvdtrain.stage.{name}",
                           process_set=self.stage_set)
        state = hvd.broadcast_object(self.optimizer.state_dict(), root, name="hvdtrain.stage.opt",
                                     process_set=self.stage_set)
        if self.rank != root:
            self.optimizer.load_state_dict(state)

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        raise HvdtrainError("pipeline stages do not resize (elastic mode is refused with them)")

    def train_step(self, step: StepIndices, lr: float) -> dict[str, float]:
        result = train_step(self.stage_kernels, self.exchange, step, lr, self.data_size)
        self._stats = result.stats
        if self._metric_keys is None:
            self._metric_keys = self._agreed_keys(self.last_sums)
        return self._stage_sums(self.last_sums, self._metric_keys)

    def _agreed_keys(self, sums: dict[str, float]) -> list[str]:
        """The metric names the last stage of copy 0 reports, on every rank (a collective): the
        loop's cross-rank sum needs the same keys everywhere."""
        root = self.layout.rank_of(self.last_stage, 0)
        keys = sorted(sums) if self.rank == root else None
        return list(self.collectives.broadcast_object(keys, root_rank=root))

    def _stage_sums(self, sums: dict[str, float], keys: Sequence[str]) -> dict[str, float]:
        """The last stage's sums; zeros on the others, so that the loop's sum over all ranks
        counts every sample once."""
        own = sums if self.last else {}
        return {key: float(own.get(key, 0.0)) for key in keys}

    @torch.no_grad()
    def evaluate(self, batches: Iterable[np.ndarray]) -> dict[str, float]:
        self.model.eval()
        if self._eval_runner is None:
            self._eval_runner = Runner(self, self.eval_rows)
        shards = list(batches)
        loaded: Iterable[Any] = (self.data.eval_batches(shards) if self.loads_data
                                 else [(None, None)] * len(shards))
        sums: dict[str, float] = {}
        for batch in loaded:
            x, y, real = (self.padded(batch, self.eval_rows) if self.loads_data
                          else (None, None, 0))
            for key, value in self._eval_runner.run(x, y, real, 1.0, training=False).items():
                sums[key] = sums.get(key, 0.0) + value
        self.model.train()
        return self._stage_sums(sums, self._agreed_keys(sums or {"loss": 0.0, "count": 0.0}))

    def parameters(self) -> dict[str, np.ndarray]:
        """This rank's parameters, named by global layer index as in the whole ``Sequential``."""
        return {name: p.detach().cpu().numpy().copy()
                for module in self.modules.values() for name, p in module.named_parameters()}

    def placement(self) -> dict[str, str]:
        return {**super().placement(), "pipeline": f"{self.layout.stages} stages x "
                                                   f"{self.layout.copies} copies"}
