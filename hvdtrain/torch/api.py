"""Your own PyTorch loop on hvdtrain: :class:`Trainer`, a small Fabric-sized API (docs/own-loop.md).

The loop stays the user's; everything beneath it is the config-driven trainer's own code, not a
copy: the engine (:class:`LoopEngine` is :class:`~hvdtrain.torch.engine.TorchEngine` around the
user's model and optimizer), the gradient exchange the config selects, the step's exchange and
update (:func:`hvdtrain.step.exchange_and_update`), the loss scaler, the global-batch sampler,
the learning-rate schedule, the checkpoint manager and its resume path, the stop signals and
the metric sinks. So a user loop and ``hvdtrain train`` on the same model, data and config end
with the same parameters (tests/multirank/test_own_loop.py)::

    trainer = Trainer("configs/digits_torch.yaml", ["train.epochs=3"])
    model, optimizer = trainer.setup(model)          # optimizer: the config's, or pass your own
    loader = trainer.dataloader(dataset)
    for epoch in trainer.epochs():
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            trainer.backward(F.cross_entropy(model(x), y))
            optimizer.step()
        trainer.log({"loss": ...})
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.utils.data

from hvdtrain.checkpoint import CheckpointManager
from hvdtrain.config import Config, load_config
from hvdtrain.data.loading import loader_workers
from hvdtrain.data.sampler import EpochPlan, StepIndices
from hvdtrain.driver import start_on_rank0
from hvdtrain.errors import EnvironmentFailure, HvdtrainError
from hvdtrain.exchange import ExchangeRequest
from hvdtrain.layout import dedicated
from hvdtrain.loop import Position, make_sampler, total_steps
from hvdtrain.observe.records import MetricsLogger
from hvdtrain.own_loop import OwnLoop
from hvdtrain.ps.mpi import ps_settings
from hvdtrain.rundir import RunDir
from hvdtrain.schedule import lr_at
from hvdtrain.session import Start
from hvdtrain.signals import StopRequest, ignore_in_helper
from hvdtrain.step import exchange_and_update
from hvdtrain.torch import syncbn
from hvdtrain.torch.device import place
from hvdtrain.torch.engine import TorchEngine, make_optimizer
from hvdtrain.torch.exchange import make_exchange
from hvdtrain.torch.precision import Precision
from hvdtrain.torch.step import TorchKernels
from hvdtrain.world import World

EXIT_USAGE, EXIT_ENVIRONMENT = 2, 74  # the CLI's exit codes (hvdtrain.cli)


def build_exchange(cfg: Config, engine: TorchEngine, optimizer: torch.optim.Optimizer
                   ) -> tuple[Any, torch.optim.Optimizer]:
    """The configured gradient exchange around ``optimizer``: the one place this module calls
    :func:`hvdtrain.torch.exchange.make_exchange` (its signature is the seam's to change)."""
    params = [p for p in engine.model.parameters() if p.requires_grad]
    return make_exchange(cfg, ExchangeRequest(
        cfg.comm, cfg.seed, engine.rank, engine.size, params, optimizer=optimizer,
        model=engine.model, accumulation=cfg.train.backward_passes_per_step, ps=ps_settings(cfg),
        shard=cfg.shard, layout=engine.layout))


class LoopEngine(TorchEngine):
    """The trainer's PyTorch engine around a user's model and optimizer: no model adapter and no
    loader; its broadcast, state I/O and exchange are :class:`TorchEngine`'s."""

    def __init__(self, cfg: Config) -> None:  # no super(): it would build a model
        kind = self._start(cfg)
        torch.manual_seed(cfg.seed + self.rank)  # as the trainer, before the user builds the model
        self.device = place(kind, self.local_rank, self.local_size)
        self.precision = Precision(cfg.train.precision, self.device,
                                   loss_scale=cfg.train.loss_scale)
        self.accumulation = cfg.train.backward_passes_per_step
        self.last_meta: dict[str, Any] = {}

    def attach(self, cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Places ``model`` and wraps ``optimizer`` in the configured exchange."""
        if cfg.model.sync_batchnorm:
            model = syncbn.convert(model, self.device)
        self.model = model.to(self.device)
        self.exchange, self.optimizer = build_exchange(cfg, self, optimizer)
        self.precision.attach(self.optimizer)
        # The step's kernels without an adapter or loader: the user's loop does the forward pass.
        self.kernels = TorchKernels(self.model, self.optimizer, cast(Any, None), cast(Any, None),
                                    self.precision)
        self._stats: dict[str, float] = {}

    def load_state(self, data: bytes, where: str) -> dict[str, Any]:
        self.last_meta = super().load_state(data, where)
        return self.last_meta


class GlobalBatchSampler:
    """A ``DataLoader`` batch sampler over hvdtrain's global batches: this rank's micro-batches of
    each step, in order; every rank yields as many (a short step's may be empty). ``set_epoch``
    picks the epoch's permutation, as ``DistributedSampler``'s does."""

    def __init__(self, trainer: Trainer, num_samples: int) -> None:
        self.trainer, self.num_samples = trainer, num_samples
        engine = trainer.engine
        self.sampler = make_sampler(trainer.cfg, num_samples, engine.accumulation)
        self.epoch = trainer.position.epoch

    def set_epoch(self, epoch: int) -> None:
        """Shuffles by ``(seed, epoch)``: call it before each epoch, or every epoch repeats."""
        self.epoch = epoch

    def plan(self) -> EpochPlan:
        """This rank's steps of the current epoch, from the position a resume left in it."""
        pos, engine = self.trainer.position, self.trainer.engine
        start = pos.in_epoch if self.epoch == pos.epoch else 0
        return self.sampler.steps(self.epoch, engine.data_rank, engine.data_size, start)

    def __iter__(self) -> Iterator[list[int]]:
        plan = self.plan()
        self.trainer.begin_epoch(self.epoch, plan, self.num_samples)
        for step in plan:
            for micro in step.micro:
                yield micro.tolist()

    def __len__(self) -> int:
        return len(self.plan()) * self.sampler.accumulation


class EmptyAware:
    """The loader's collate function: a rank's empty micro-batch becomes a batch of no samples
    shaped like the others, so that every rank runs the same number of backward passes."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any]) -> None:
        self.dataset, self.collate = dataset, collate

    def __call__(self, items: list[Any]) -> Any:
        if items:
            return self.collate(items)
        one = self.collate([self.dataset[0]])
        return torch.utils._pytree.tree_map(
            lambda t: t[:0] if isinstance(t, torch.Tensor) else t, one)


def _worker_init(worker_id: int) -> None:
    """Loader workers leave the stop signals to their rank (:func:`hvdtrain.signals.ignore_in_helper`)."""
    ignore_in_helper()


class WrappedOptimizer:
    """The user's optimizer as the loop sees it: ``step`` runs the trainer's exchange and update
    once per global batch, ``zero_grad`` zeroes only at a step's start, so that a plain loop
    (zero_grad, backward, step each batch) accumulates ``train.backward_passes_per_step``
    micro-batches. Other attributes are the wrapped optimizer's."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def step(self, closure: Any = None) -> None:
        """Exchanges the gradients and updates, at the last micro-batch of a global batch."""
        if closure is not None:
            raise HvdtrainError("optimizer.step(closure): closures are not supported; compute "
                                "the loss in the loop and call trainer.backward(loss)")
        self._trainer.optimizer_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the gradients before a global batch's first micro-batch (no-op inside one)."""
        if self._trainer.micro == 0:
            self._trainer.settle()
            self._trainer.engine.kernels.begin()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer.engine.optimizer, name)


class Trainer(OwnLoop):
    """hvdtrain under a user's own loop; every rank makes one (see the module docstring).

    ``config`` and ``overrides`` are ``hvdtrain train``'s (None: the defaults); the sections that
    apply are ``seed``, ``data`` (batch size per rank, shuffle, workers), ``train``
    (``backward_passes_per_step``, ``precision``, ``epochs``, ``max_steps``), ``optim`` (when
    :meth:`setup` builds the optimizer), ``comm`` and ``shard`` (the exchange), ``checkpoint``
    and ``log``. Starts Horovod and seeds torch with ``seed + rank``, as the trainer does.
    """

    def __init__(self, config: str | Path | None = None, overrides: Sequence[str] = ()) -> None:
        self.cfg = cfg = load_config(config, overrides)
        refuse_unsupported(cfg)
        self.engine = LoopEngine(cfg)
        self.run_dir = RunDir(cfg.run_dir)
        self.checkpoints = CheckpointManager(cfg.checkpoint, self.run_dir.checkpoints)
        self.position = Position()
        self.resumed = False
        self.objects: dict[str, Any] = {}
        self.micro = 0  # backward passes of the current global batch so far
        self.schedule = False  # whether the config's LR schedule drives the optimizer
        self.plan: EpochPlan | None = None
        self.cursor = 0  # the step of ``plan`` being trained
        self.num_samples = 0
        self.sampler: GlobalBatchSampler | None = None
        self.logger: MetricsLogger | None = None
        self.saved_step = -1
        self.pending = False  # a step ended whose checkpoint and stop check are still to come
        # The stop check started at the last log interval, resolved after the next step: the
        # ranks' sum rides beside that step's gradients instead of stopping them for it.
        self.stop_sum: Callable[[], dict[str, float]] | None = None
        self.stop_agreed = False  # a resolved check found a stop request: sticky
        # total_steps, by (size, sampler, position)
        self._total: tuple[tuple[int, Any, Position], int] | None = None
        self.stop = StopRequest().__enter__()  # until close(): the loop is the user's

    # -- set-up -------------------------------------------------------------------------------

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
              **objects: Any) -> tuple[torch.nn.Module, WrappedOptimizer]:
        """Places ``model``, wraps ``optimizer`` (None: the config's ``optim``, whose schedule the
        trainer then sets every step) in the configured exchange, resumes as ``checkpoint.resume``
        says, and broadcasts rank 0's state. ``objects``: anything with ``state_dict`` and
        ``load_state_dict`` (an LR scheduler, a counter) saved and resumed by name."""
        self.schedule = optimizer is None
        self.engine.attach(self.cfg, model, optimizer or make_optimizer(self.cfg.optim, model))
        self.objects = dict(objects)
        start = start_on_rank0(self.cfg, self.run_dir, self.engine) if self.engine.rank == 0 \
            else Start()
        if self.cfg.elastic.enabled:
            self._elastic_start(start)
        else:
            self._share(start)
        return self.engine.model, WrappedOptimizer(self)

    def _elastic_start(self, start: Start) -> None:
        """Elastic mode: no collective before Horovod's elastic runner (a joining worker would
        meet the others in the wrong one); the state's first sync gives every rank rank 0's."""
        from hvdtrain.own_loop_elastic import LoopState
        if start.resumed:
            saved = self.engine.last_meta.get("objects", {})
            for name, obj in self.objects.items():
                if name not in saved:
                    start = Start(error=HvdtrainError(
                        f"checkpoint holds no state for setup object {name!r}"))
                    break
                obj.load_state_dict(saved[name])
            self.resumed = True
        self.elastic_state = LoopState(self, start)

    def dataloader(self, dataset: torch.utils.data.Dataset, **options: Any
                   ) -> torch.utils.data.DataLoader:
        """A ``DataLoader`` of ``dataset`` (map-style) over hvdtrain's global batches:
        ``data.batch_size`` samples per rank and micro-batch. ``options`` go to ``DataLoader``
        (``num_workers`` defaults to ``data.workers``'s choice, ``collate_fn`` to torch's)."""
        self.sampler = GlobalBatchSampler(self, len(cast(Any, dataset)))
        self.num_samples = self.sampler.num_samples
        options.setdefault("num_workers", loader_workers(self.cfg.data.workers,
                                                         self.engine.local_size))
        if options["num_workers"]:
            options.setdefault("worker_init_fn", _worker_init)
        collate = options.pop("collate_fn", torch.utils.data.default_collate)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=self.sampler,
                                             collate_fn=EmptyAware(dataset, collate), **options)
        # ``loader.sampler.set_epoch(epoch)``, as Horovod's users write it for DistributedSampler:
        # the DataLoader refuses to set ``sampler`` once built, and with a batch sampler it holds
        # a sequential one that nothing uses.
        object.__setattr__(loader, "sampler", self.sampler)
        return loader

    @property
    def total_steps(self) -> int:
        """The step at which ``train.epochs`` (capped by ``train.max_steps``) end."""
        if self.sampler is None:
            return self.cfg.train.max_steps
        # Read twice a step: computed once per world size and loader. A step moves the position
        # by one global batch, which leaves the end where it was; a reset or a load may not.
        # The position object is part of the key: a resume in setup() replaces it (an equal
        # one ends at the same step).
        key = (self.engine.data_size, self.sampler, self.position)
        if self._total is None or self._total[0] != key:
            self._total = key, total_steps(self.cfg.train, self.sampler.sampler,
                                           self.engine.data_size, dataclasses.replace(self.position))
        return self._total[1]

    @property
    def device(self) -> torch.device:
        """The device the model is placed on (put batches there)."""
        return self.engine.device

    def autocast(self) -> Any:
        """The forward pass's context for ``train.precision`` (bf16/fp16 autocast, or none)."""
        return self.engine.precision.autocast()

    # -- the step -----------------------------------------------------------------------------

    def begin_epoch(self, epoch: int, plan: EpochPlan, num_samples: int) -> None:
        """Called by the loader's sampler as an epoch's iteration starts."""
        if epoch != self.position.epoch:
            self.position.epoch, self.position.in_epoch = epoch, 0
            self._total = None  # the loop moved the position itself: the end may move
        self.plan, self.cursor, self.micro = plan, 0, 0

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagates ``loss``, the mean over this micro-batch's samples, weighted so that
        the exchanged gradient is the mean over the global batch (ranks may hold unequal
        shares), through the loss scaler; the gradients accumulate over the step's micro-batches."""
        # The hot path of every user step: attributes read once, the no-op calls skipped
        # (benchmarks/overhead.py --candidate api measures what is left).
        engine = self.engine
        if not hasattr(engine, "kernels"):
            raise HvdtrainError("trainer.backward() before trainer.setup(model, optimizer)")
        if self.pending:
            self.settle()
        step, accumulation, micro = self._current(), engine.accumulation, self.micro
        if self.elastic_state is not None:
            self.check_elastic(step, "backward")
        engine.exchange.backward_starts(micro == accumulation - 1)
        if step is None:  # the user's own loader: equal shares assumed
            engine.precision.backward(loss, 1.0 / accumulation)
        else:
            count = len(step.micro[micro])
            if count == 0:  # nothing here: zero gradients still join the exchange
                params = [p for p in engine.model.parameters() if p.requires_grad]
                cast(torch.Tensor, sum(p.sum() for p in params)).backward(torch.tensor(0.0))
            else:
                engine.precision.backward(loss, engine.data_size * count / step.global_count)
        self.micro = micro + 1

    def optimizer_step(self) -> None:
        """The wrapped optimizer's ``step``: at a global batch's last micro-batch, the exchange and
        update, then the position advances and a checkpoint or stop may follow."""
        engine = self.engine
        if not hasattr(engine, "kernels"):
            raise HvdtrainError("optimizer.step() before trainer.setup(model, optimizer)")
        if self.micro < engine.accumulation:
            return  # accumulating: the exchange runs once per global batch
        if self.schedule:
            engine.kernels.set_lr(self.lr())
        engine.exchange.run_length(self.total_steps)  # comm.dense_fraction's steps
        engine._stats = exchange_and_update(engine.kernels, engine.exchange)
        step = self._current()
        if self.elastic_state is not None and step is not None:
            self.elastic_state.record.add(self.position.epoch, step)
        self._advance(step)
        self.pending = True

    def lr(self) -> float:
        """The config's learning rate for the coming step (warm-up, scaling, schedule)."""
        world = World.of(self.cfg, self.engine.data_size)
        return lr_at(self.position.step, self.total_steps, self.cfg.optim,
                     self.engine.data_size, base_lr=world.lr)

    def _advance(self, step: StepIndices | None) -> None:
        """Moves the position past ``step`` (this step's indices; None: the user's own loader)."""
        pos = self.position
        self.micro = 0
        pos.step += 1
        if step is None:
            return
        self.cursor += 1
        pos.in_epoch += step.global_count
        pos.samples += step.global_count
        if pos.in_epoch >= self.num_samples:
            pos.epoch, pos.in_epoch = pos.epoch + 1, 0

    def settle(self, finished: bool = False) -> None:
        """The step boundary after ``optimizer.step()``, run when the next step starts (its
        ``zero_grad`` or first ``backward``) or at :meth:`close`: the user's code after the step
        (a scheduler's step, a counter) is then in the checkpoint. Periodic checkpoints, and stop
        requests: summed over the ranks at each log interval beside the next step's gradients
        (as the trainer's metrics are), and acted on after that step; none at the end."""
        if not self.pending:
            return
        self.pending = False
        step = self.position.step
        stop = self.agreed_stop()
        if self.checkpoints.due(step) and self.saved_step != step:
            self.save()
        if finished:
            return
        self._commit_if_due()
        if stop:
            self._stop()
        if step % self.cfg.log.every_steps == 0:
            self.stop_sum = self.engine.collectives.start_allreduce_sums(
                {"stop": float(self.stop())})

    def agreed_stop(self) -> bool:
        """Waits for the stop check in flight (started at the last log interval, a step or more
        ago, so summed by now) and returns whether any rank has asked to stop. Every rank
        resolves it at the same point of the loop (a step boundary, ``log``, ``load``, ``close``),
        so all stop after the same step."""
        pending, self.stop_sum = self.stop_sum, None
        if pending is not None and pending()["stop"] > 0:
            self.stop_agreed = True
        return self.stop_agreed

    def log(self, metrics: Mapping[str, float], step: int | None = None) -> dict[str, float]:
        # The stop check and the metric sums share one collective's name: one in flight at a
        # time. A stop it found is acted on at the next step boundary.
        self.agreed_stop()
        return super().log(metrics, step)

    def save(self) -> Path | None:
        self.agreed_stop()  # the checkpoint's own agreement is a sum too (see log)
        return super().save()

    def load(self, path: str | Path | None = None) -> bool:
        self._total = None  # the restored position may end elsewhere (another max_steps)
        self.agreed_stop()
        return super().load(path)

    def _restart(self) -> None:
        # After an elastic reset a sum in flight belongs to the old world: dropped, not waited.
        self.micro, self.pending, self.stop_sum, self._total = 0, False, None, None


    def parameters(self) -> dict[str, Any]:
        """The model's parameters as NumPy arrays, by name (for checks)."""
        return self.engine.parameters()

    def close(self) -> None:
        """Ends the run: the last checkpoint is on disk, the sinks closed, the exchange ended and
        the stop-signal handlers restored. Every rank calls it once, after the loop."""
        try:
            self.settle(finished=True)
            self.agreed_stop()  # nothing stays in flight: the run ends either way
            if self.logger is not None:
                self.logger.close()
                self.logger = None
        finally:
            self.checkpoints.wait()
            if hasattr(self.engine, "exchange"):  # set up: its exchange ends (servers told)
                self.engine.finish()
            self.stop.__exit__(None, None, None)


def refuse_unsupported(cfg: Config) -> None:
    """One-line refusals of what :class:`Trainer` does not do (yet)."""
    if cfg.framework != "torch":
        raise HvdtrainError(f"framework={cfg.framework!r}: hvdtrain.torch.Trainer trains PyTorch "
                            "models; set framework=torch")
    if cfg.elastic.enabled and cfg.elastic.on_resize != "scale_lr":
        raise HvdtrainError(f"elastic.on_resize={cfg.elastic.on_resize!r}: "
                            "hvdtrain.torch.Trainer's elastic mode keeps the per-rank batch "
                            "(scale_lr); use `hvdtrain train` for keep_global_batch")
    if cfg.pipeline.stages > 1 or dedicated(cfg):
        raise HvdtrainError("pipeline.stages>1 and ps.placement=dedicated need `hvdtrain train`: "
                            "hvdtrain.torch.Trainer wraps one whole model per rank")


def launch(main: Callable[[], Any]) -> None:
    """Runs ``main()`` and exits as ``hvdtrain train`` would: an :class:`HvdtrainError` prints one
    line (``hvdtrain: error: ...``) and exits 2 (74 for a failing environment)."""
    try:
        main()
    except EnvironmentFailure as exc:
        print(f"hvdtrain: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_ENVIRONMENT)
    except HvdtrainError as exc:
        print(f"hvdtrain: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


__all__ = ["GlobalBatchSampler", "LoopEngine", "Trainer", "WrappedOptimizer", "launch"]
