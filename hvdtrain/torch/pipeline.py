"""PyTorch pipeline stages composed with Horovod data parallelism (``pipeline.stages`` > 1).

Each rank builds only its own pieces of the model from the adapter's layer factories
(:meth:`hvdtrain.adapters.ModelAdapter.layers`), cut by :mod:`hvdtrain.pipeline.split` and placed
by :class:`hvdtrain.layout.Layout` and the schedule. ``torch.distributed.pipelining``
carries activations and their gradients between the stages of one pipeline copy over a torch
process group of that copy's ranks (Gloo on CPU, NCCL on GPU); its rendezvous address is chosen by
rank 0 and handed out by Horovod. Each stage's gradients are averaged over that stage's copies by
Horovod in a process set (the run's gradient exchange, any ``comm.compression``, or with
``shard.stage=1`` the sharded update among the stage's copies:
:func:`hvdtrain.torch.stages.make_stage_exchange`), once per step after the last micro-batch,
so :func:`hvdtrain.step.train_step` runs a pipeline step as it runs any other: one
"micro-batch" per step whose backward pass is the whole schedule.

Checkpoints do not depend on the split (:class:`hvdtrain.engine.PartedState`): each stage's
first copy writes its own layers as a part keyed by global layer index, and on resume each rank
reads the parts that hold its layers under the new split (:mod:`hvdtrain.pipeline.state`); a
checkpoint written without stages is cut into each rank's share by rank 0.

Shapes never change between steps: a copy's batch is padded to ``data.batch_size`` by repeating
its samples, and the padded rows are left out of the loss and metrics (weight zero).
"""

from __future__ import annotations

import functools
import io
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from hvdtrain.compression.state import by_index, by_name, merge_named
from hvdtrain.config import Config
from hvdtrain.data import tree
from hvdtrain.data.contracts import Dataset, DatasetSpec
from hvdtrain.data.loading import loader_workers
from hvdtrain.data.sampler import StepIndices
from hvdtrain.engine import PartedState
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import ExchangeRequest
from hvdtrain.pipeline import SCHEDULES, Schedule, layer_names, stage_bounds
from hvdtrain.pipeline.schedules import microbatch_count
from hvdtrain.pipeline.state import (
    layer_of,
    merge_parts,
    misfit,
    parts_holding,
    parts_misfit,
    select_part,
)
from hvdtrain.step import StepKernels, add_batch_sums, train_step
from hvdtrain.torch import rng
from hvdtrain.torch.data import TorchLoader
from hvdtrain.torch.device import place
from hvdtrain.torch.engine import TorchEngine, make_optimizer
from hvdtrain.torch.parts import part_bytes, read_parts, read_state
from hvdtrain.torch.precision import Precision
from hvdtrain.torch.shard import ShardedOptimizer
from hvdtrain.torch.shard_files import sources, whole_state
from hvdtrain.torch.shard_units import UnitShardedOptimizer
from hvdtrain.torch.stages import (
    SavedActivations,
    build_pieces,
    describe_layers,
    layers_of,
    make_optimizer_state,
    make_stage_exchange,
    pad_rows,
    pipeline_groups,
    stage_sets,
    start_torch_distributed,
)


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
        for stage in stages:  # the stage's own compute: its chunks' passes, timed in place
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._timed(getattr(stage, name)))
        self.schedule = cls(stages[0] if single else stages, engine.microbatches,
                            loss_fn=self._timed(self._loss), scale_grads=False)
        self.compute_s = self.step_s = 0.0
        self.activations = SavedActivations()
        self.calls: list[tuple[torch.Tensor, dict[str, Any], int]] = []
        self.y: Any = None
        self.real, self.weight, self.training = 0, 0.0, True

    def run(self, x: Any, y: Any, real: int, weight: float, training: bool) -> dict[str, float]:
        """Runs the schedule over one padded batch (``x`` on the first stage, ``y`` on the last,
        None elsewhere) whose first ``real`` rows count; returns the loss and metric sums (the
        last stage's; empty elsewhere)."""
        self.y, self.real, self.weight, self.training = y, real, weight, training
        self.calls = []
        args = (x,) if self.engine.first else ()
        target = torch.arange(self.rows, device=self.engine.device) if self.engine.last else None
        self.compute_s, started = 0.0, time.perf_counter()
        if training:
            with self.activations.hooks():
                self.schedule.step(*args, target=target, return_outputs=False)
        else:
            self.schedule.eval(*args, target=target, return_outputs=False)
        self.step_s = time.perf_counter() - started
        self.y = None
        if not self.engine.last:
            return {}
        sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
        # The micro-batches' calls are the last m: on its first step torch calls the loss once
        # more beforehand, on placeholder outputs, to learn the gradients' shapes.
        for loss_sum, metrics, count in self.calls[-self.engine.microbatches:]:
            add_batch_sums(sums, loss_sum, metrics, count)
        self.calls = []
        return sums

    def wait_s(self) -> float:
        """The last schedule's seconds outside this stage's compute: waiting for and moving
        activations and gradients (the pipeline's bubble, as this rank saw it)."""
        return max(self.step_s - self.compute_s, 0.0)

    def _timed(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """``func``, its seconds added to :attr:`compute_s` (on a GPU after its kernels end, so
        that they are not counted as the wait that follows)."""
        cuda = self.engine.device.type == "cuda"

        @functools.wraps(func)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = func(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize(self.engine.device)
            self.compute_s += time.perf_counter() - started
            return result

        return timed

    def _loss(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch (``rows``: its rows' places in the batch):
        the adapter's summed loss over its real rows, times the step's weight."""
        keep = rows < self.real
        y = tree.map_tree(lambda t: t[rows[keep]], self.y)
        loss_sum, metrics = self.engine.adapter.output_loss(output[keep], y, self.training)
        self.calls.append((loss_sum.detach(), metrics, int(keep.sum())))
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
        own = getattr(self.engine.optimizer, "gradients", None)
        if own is not None:  # shard.stage 2-3: the optimizer holds its shards' gradients
            return list(own())
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        return grads


class PipelineEngine(TorchEngine, PartedState):
    """A :class:`~hvdtrain.torch.engine.TorchEngine` whose rank holds one stage of one pipeline
    copy; see the module docstring. ``data_rank``/``data_size`` are the copy and the copies."""

    def __init__(self, cfg: Config, dataset: Dataset) -> None:
        kind = self._start(cfg, process_sets=True)
        self._place(cfg)
        self.device = place(kind, self.local_rank, self.local_size)
        start_torch_distributed(self.collectives, self.device, cfg.train.stall_timeout_s)
        self.group = pipeline_groups(self.layout, self.rank)
        sets = stage_sets(self.layout, cfg)
        self.modules = self._build_pieces(cfg, dataset.spec())
        torch.manual_seed(cfg.seed + self.rank)
        for module in self.modules.values():
            module.to(self.device)
        self.model = nn.ModuleDict({str(k): m for k, m in self.modules.items()})
        # shard.stage 2-3: the rank's layers are the units (their hooks run in the schedule's
        # passes); its state_dict stands for the pieces' (stage 3's freed parameters).
        self.units_model = layers_of(self.modules) if cfg.shard.stage >= 2 else None
        self.precision = Precision(cfg.train.precision, self.device)
        self.data = TorchLoader(dataset.train(), dataset.test(), seed=cfg.seed,
                                rank=self.data_rank,
                                workers=loader_workers(cfg.data.workers, self.local_size),
                                prefetch=cfg.data.prefetch, device=self.device)
        self.accumulation = 1
        self.stage_set = sets[self.stage]
        trainable = [(n, p) for m in self.modules.values() for n, p in m.named_parameters()
                     if p.requires_grad]
        self.trainable = [name for name, _ in trainable]
        """The global names of the exchange's tensors, in its order (its state by name)."""
        self.exchange, self.optimizer = make_stage_exchange(cfg, ExchangeRequest(
            cfg.comm, cfg.seed, self.layout.copy_of(self.rank), self.layout.copies,
            [p for _, p in trainable], optimizer=make_optimizer(cfg.optim, self.model),
            model=self.units_model or self.model, shard=cfg.shard,
            accumulation=self.microbatches,
            layout=self.layout, places=[self.all_trainable.index(n) for n in self.trainable],
            process_set=self.stage_set,
            root=self.layout.rank_of(self.layout.stage_of(self.rank), 0)))
        self.precision.attach(self.optimizer)
        self.stage_kernels = PipelineKernels(self)
        self.batch_rows, self.eval_rows = cfg.data.batch_size, cfg.data.eval_batch_size
        self.train_runner = Runner(self, self.batch_rows)
        self._eval_runner: Runner | None = None
        self.own_params = [name for m in self.modules.values() for name, _ in m.named_parameters()]
        self._restored: dict[str, Any] | None = None  # rank 0's: a whole checkpoint, or parts
        self.last_sums: dict[str, float] = {}
        self._metric_keys: list[str] | None = None
        self._stats: dict[str, float] = {}
        self.model.train()

    def _place(self, cfg: Config) -> None:
        """Where this rank stands: its stage and copy, its pieces, who reads the data."""
        pipe = cfg.pipeline  # self.layout: the job's layout of ranks, made as Horovod started
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
        costs, self.all_params, self.all_keys, self.all_trainable = describe_layers(factories)
        self.factories = factories  # the whole model on the meta device, for shard files
        self.layer_count = len(factories)
        self.bounds = stage_bounds(cfg.pipeline.split, costs, layer_names(factories), self.pieces)
        self._check_every_rank_trains(costs)
        # shard.stage=3: each layer cut to this copy's shard as it is made (on the CPU, as
        # without stages: moving freed parameters to a GPU afterwards is not built).
        shard = ((self.copy, self.layout.copies)
                 if cfg.shard.stage == 3 and self.device.type == "cpu" else None)
        return build_pieces(factories, self.bounds, self.mine, cfg.seed, shard)

    def _check_every_rank_trains(self, costs: Sequence[int]) -> None:
        """Refuses a split that leaves a rank of the pipeline without parameters (every rank
        checks every rank, so all stop together)."""
        for stage in range(self.layout.stages):
            layers = self._layers_of(self.layout.rank_of(stage, 0))
            if not sum(costs[i] for i in layers):
                raise HvdtrainError(
                    f"pipeline.split: stage {stage} would hold layers {sorted(layers)}, which have "
                    f"no parameters (split bounds {self.bounds}); name other split points or "
                    "use fewer stages")

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
        """Every rank takes its stage's share of rank 0's state: of the checkpoint rank 0 restored
        (from a checkpoint in parts, each rank reads the parts that hold its layers; from one
        written whole, rank 0 sends each rank its share by torch's scatter), or else that of copy
        0's rank of its stage (a broadcast in the stage's process set), whose fresh optimizer made
        its state as the ring's does (:func:`~hvdtrain.torch.stages.make_optimizer_state`)."""
        restored = self._restored if self.rank == 0 else None
        kind = self.collectives.broadcast_object(
            [None if restored is None else restored.get("parts", "whole")])[0]
        if kind is not None and kind != "whole":
            self._load_own_parts(Path(kind["directory"]), kind["entries"], kind["where"])
            self._restored = None
            return
        if kind == "whole":
            parts = [self._part_for(r) for r in range(self.size)] if self.rank == 0 else None
            received: list[Any] = [None]
            dist.scatter_object_list(received, parts, src=0)
            if self.rank != 0:
                model, optimizer, compression = received[0]
                self._apply(model, optimizer, compression, "the restored checkpoint")
            self._restored = None
            return
        # A fresh start: the optimizer's state as the ring makes it (Adam's step count, weight
        # decay's first change), on every rank before the stage's copies take copy 0's.
        sharded = isinstance(self.optimizer, ShardedOptimizer | UnitShardedOptimizer)
        if not sharded:
            make_optimizer_state(self.optimizer)
        if self.stage_set is None:
            return
        root = self.layout.rank_of(self.stage, 0)
        for name, tensor in sorted(self.model.state_dict().items()):
            if tensor.numel() and not tensor.untyped_storage().size():
                continue  # shard.stage=3: a freed parameter (its shards are cut alike anyway)
            hvd.broadcast_(tensor, root, name=f"hvdtrain.stage.{name}",
                           process_set=self.stage_set)
        if sharded:  # shard.stage 1-3: after copy 0's weights, the zero step on the shards
            self.exchange.broadcast(root_rank=root)
            return
        state = hvd.broadcast_object(self.optimizer.state_dict(), root, name="hvdtrain.stage.opt",
                                     process_set=self.stage_set)
        if self.rank != root:
            self.optimizer.load_state_dict(state)

    def _layers_of(self, rank: int) -> set[int]:
        """The global indices of the layers that ``rank`` holds."""
        pieces = self.schedule.pieces_of(self.layout.stage_of(rank), self.layout.stages,
                                         self.pieces // self.layout.stages)
        return {i for p in pieces for i in range(self.bounds[p], self.bounds[p + 1])}

    def _part_for(self, rank: int) -> tuple[dict, dict, dict]:
        """Rank ``rank``'s share of the restored checkpoint (model entries, optimizer state,
        exchange state by parameter name)."""
        assert self._restored is not None
        return self._share(self._restored["model"], self._restored["optimizer"],
                           by_name(self._restored.get("compression"), self.all_trainable), rank)

    def _share(self, model: dict, optimizer: dict, compression: dict, rank: int
               ) -> tuple[dict, dict, dict]:
        """Rank ``rank``'s share of a whole model's entries, optimizer state and exchange state
        (slots by parameter name: :func:`hvdtrain.compression.state.by_name`)."""
        layers = self._layers_of(rank)
        own = [name for name in self.all_params if layer_of(name) in layers]
        slots = {k: v for k, v in compression.items()
                 if "/" not in k or layer_of(k.partition("/")[2]) in layers}
        return (*select_part(model, optimizer, self.all_params, own, layers), slots)

    def _load_own_parts(self, directory: Path, entries: list[dict], where: str) -> None:
        """Every rank reads the parts of a checkpoint in parts that hold its layers (under this
        run's split) and loads its share; a failure on any rank stops every rank (a
        collective), rather than leaving the others waiting in the first step."""
        problem = None
        try:
            layers = self._layers_of(self.rank)
            parts = read_parts(directory, parts_holding(entries, layers), where)
            model, optimizer, compression = self._share(
                *merge_parts(parts, self.all_params),
                merge_named([p["compression"] for p in parts], where), self.rank)
            want = {k for k in self.all_keys if layer_of(k) in layers}
            if model.keys() != want:
                raise HvdtrainError(f"{where} does not fit the model: entries "
                                    f"{', '.join(sorted(model.keys() ^ want)[:3])} are missing "
                                    "from its parts or unexpected")
            self._apply(model, optimizer, compression, where)
        except HvdtrainError as exc:
            problem = str(exc)
        except Exception as exc:  # noqa: BLE001  (entries of the wrong shape: one line)
            first = str(exc).strip().splitlines() or [type(exc).__name__]
            problem = f"{where} does not fit the model: {first[0].strip()}"
        # In a list: Horovod names the collective after the object's type (None or a str).
        failures = [p[0] for p in self.collectives.allgather_object([problem]) if p[0]]
        if failures:
            raise HvdtrainError(failures[0])

    def _apply(self, model: dict, optimizer: dict, compression: dict, where: str) -> None:
        """Loads this rank's share of a checkpoint into its pieces, optimizer and exchange (whose
        per-copy state, saved by another number of copies, is re-sharded to this one's)."""
        if self.units_model is not None:  # shard.stage 2-3 (stage 3: each cuts its own shard)
            self.units_model.load_state_dict(model)
            own_shards(self.optimizer)
        else:
            for piece, module in self.modules.items():
                first, end = self.bounds[piece], self.bounds[piece + 1]
                module.load_state_dict({k: v for k, v in model.items()
                                        if first <= layer_of(k) < end})
        self.optimizer.load_state_dict(optimizer)
        if isinstance(self.optimizer, ShardedOptimizer | UnitShardedOptimizer):
            # Every rank took its shard of its stage's whole state: nothing to broadcast, and
            # the whole state kept for a broadcast would only hold memory.
            self.optimizer._full = None
        self.exchange.load_state_dict(by_index(compression, self.trainable), where)

    def part_bytes(self) -> tuple[str, list[int], bytes] | None:
        """Copy 0's ranks write their layers, with every copy's exchange state (residuals differ
        per copy: gathered first, a collective in the stage's set); the other copies hold the
        same layers."""
        self.exchange.gather()
        if self.copy != 0:
            return None
        compression = by_name(self.exchange.state_dict(), self.trainable)
        # shard.stage=3: the layers' state_dict holds the parameters gather() kept on copy 0.
        modules = [self.units_model] if self.units_model is not None else self.modules.values()
        return (f"stage-{self.stage}", sorted(self._layers_of(self.rank)),
                part_bytes(modules, self.own_params, self.optimizer, compression))

    def state_bytes(self, meta: dict[str, Any]) -> bytes:
        """Rank 0's ``step-N.ckpt`` beside the parts: the random and precision states and ``meta``
        (which lists the parts), no model."""
        buffer = io.BytesIO()
        torch.save({"model": {}, "optimizer": {}, "rng": rng.capture(),
                    "precision": self.precision.state_dict(), "compression": None,
                    "meta": meta}, buffer)
        return buffer.getvalue()

    def load_state(self, data: bytes, where: str) -> dict[str, Any]:
        """Rank 0 restores a checkpoint (in parts of any split, or of the whole model) and keeps
        what :meth:`broadcast_state` needs to hand every rank its share."""
        state = read_state(data, where)
        source = sources(state, self.restore_from, where)
        if source is not None:  # every rank's shard files (sharded, no stages): assembled whole
            model, optimizer = whole_state(source, self._whole_on_meta())
            state = {**state, "model": model, "optimizer": optimizer}
        entries = None if source is not None else state["meta"].get("parts")
        if entries:
            problem = parts_misfit(entries, self.layer_count)
            if problem or self.restore_from is None:
                raise HvdtrainError(f"{where} does not fit the model: {problem or 'no parts'}")
            self._restored = {"parts": {"directory": str(self.restore_from.parent),
                                        "entries": entries, "where": where}}
        else:
            problem = misfit(state["model"].keys(), state["optimizer"], self.all_keys,
                             self.all_params)
            if problem:
                raise HvdtrainError(f"{where} does not fit the model: {problem}")
            self._restored = state
        try:
            if not entries:  # from parts, every rank (rank 0 too) loads in broadcast_state
                self._apply(*self._part_for(self.rank), where=where)
            self.precision.load_state_dict(state.get("precision"))
        except Exception as exc:  # noqa: BLE001  (entries of the wrong shape: one line)
            first = str(exc).strip().splitlines() or [type(exc).__name__]
            raise HvdtrainError(f"{where} does not fit the model: {first[0].strip()}") from None
        if "rng" in state:
            rng.restore(state["rng"])
        return state["meta"]

    def _whole_on_meta(self) -> nn.Module:
        """The whole model's layers on the meta device (no memory): its parameters' global names
        and sizes, which a checkpoint of shard files is read by."""
        with torch.device("meta"):
            return nn.Sequential(OrderedDict((str(i), make())
                                             for i, make in enumerate(self.factories)))

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        raise HvdtrainError("pipeline stages do not resize (elastic mode is refused with them)")

    def train_step(self, step: StepIndices, lr: float) -> dict[str, float]:
        result = train_step(self.stage_kernels, self.exchange, step, lr, self.data_size)
        self._stats = result.stats
        # As TensorFlow's stages report it: the wait apart, the rest of the step is compute.
        wait = self.train_runner.wait_s()
        self._stats["pipe_wait_s"] = wait
        self._stats["compute_s"] = max(self._stats["compute_s"] - wait, 0.0)
        self._stats["activation_mb"] = self.train_runner.activations.peak / 2**20
        if self._metric_keys is None:
            self._metric_keys = self._agreed_keys(self.last_sums)
        return self._stage_sums(self.last_sums, self._metric_keys)

    def _agreed_keys(self, sums: dict[str, float]) -> list[str]:
        """The metric names the last stage of copy 0 reports, on every rank (a collective): the
        loop's cross-rank sum needs the same keys everywhere."""
        root = self.layout.rank_of(self.last_stage, 0)
        keys = sorted(sums) if self.rank == root else []
        # In a list on every rank: Horovod names the broadcast after the object's type.
        return list(self.collectives.broadcast_object([keys], root_rank=root)[0])

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
        """This rank's parameters, named by global layer index as in the whole ``Sequential``
        (shard.stage=3: gathered whole within the stage's copies first, a collective of every
        rank: one that leaves before another stage's gather ends would shut Horovod down)."""
        if isinstance(self.optimizer, UnitShardedOptimizer):
            self.optimizer.sharding.gather_all(keep=True)
            self.collectives.allgather_object(None)
        return {name: p.detach().cpu().numpy().copy()
                for module in self.modules.values() for name, p in module.named_parameters()}

    def pipeline_stages(self) -> list[int]:
        return [self.layout.stage_of(r) for r in range(self.size)]

    def placement(self) -> dict[str, str]:
        return {**super().placement(), "pipeline": self.layout.describe()}


def own_shards(optimizer: torch.optim.Optimizer) -> None:
    """shard.stage=3: each unit's shard cut from the whole parameters this rank's layers just
    loaded (every copy reads its share of a checkpoint itself: nothing to broadcast)."""
    if not isinstance(optimizer, UnitShardedOptimizer):
        return
    sharding = optimizer.sharding
    restored, sharding.restored = sharding.restored, None
    if not restored:
        return
    for unit in sharding.units:
        flat = torch.cat([restored[sharding.names[id(p)]].reshape(-1).float()
                          for p in unit.params])
        unit.shard.data.copy_(flat[unit.start:unit.stop])
        if unit.full:
            unit.set_full(flat)
