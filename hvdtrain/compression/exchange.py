"""The compressing gradient exchange: runs a method's plan once per optimizer step, framework-free.

It is the ``compressing`` kind of :class:`hvdtrain.exchange.GradientExchange`. A framework subclass
(``CompressingExchange`` in :mod:`hvdtrain.torch.compression` and
:mod:`hvdtrain.tensorflow.compression`) supplies the kernels, the state storage, the collectives
and, for TensorFlow, the tracing of the stages; everything else is here, once:

- :meth:`Exchange.run` averages a step's gradients: stage 0 of every tensor, then per round the
  collectives (timed: ``comm_s``; counted: ``wire_bytes``) and the next stage.
- State: :meth:`Exchange.gather` (a collective, before a checkpoint) collects every rank's
  residuals; :meth:`Exchange.state_dict` is the checkpoint entry (NumPy arrays);
  :meth:`Exchange.load_state_dict` reads one back on the rank that read the checkpoint and
  :meth:`Exchange.broadcast` (a collective) hands every rank the step, ``Q`` and its own residuals,
  re-sharded by :func:`hvdtrain.compression.state.reshard` when the world size changed.
- :meth:`Exchange.resize` continues at another rank and world size (elastic mode).
- The adaptive rule (:class:`hvdtrain.compression.rules.Accordion`) sees every step's local
  gradient norm and, once an interval, the ranks' mean of them (one allgathered number); its state
  travels in the checkpoint and the broadcast.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hvdtrain.compression import reference as ref
from hvdtrain.compression import state
from hvdtrain.compression.kernels import Context, Kernels, Store, Tensor
from hvdtrain.compression.plans import Message, Plan, Stage, TensorPlan
from hvdtrain.compression.rules import ACCORDION, OptimizerSettings, Phase, Rule, make_rule
from hvdtrain.compression.state import RESIDUAL, slot_key
from hvdtrain.exchange import GradientExchange

Scalars = dict[str, Tensor]
"""An update rule's numbers of the step, as framework scalars (:attr:`Context.scalars`)."""

Carry = tuple[Any, tuple, Any]
"""Per tensor between stages: (``acc`` under error feedback, the plan's carry, the average once
known); ``()`` stands for "none"."""


class Exchange(GradientExchange):
    """Averages gradients over the ranks with one method's plan; see the module docstring.

    Gradients arrive unscaled (:attr:`unscaled_first`) where the plan compresses: residuals and
    ``Q`` stay in the gradients' units whatever the loss scale does."""

    kernels: Kernels
    """The framework's kernels (a class attribute of the subclass)."""

    def __init__(self, plan: Plan, rank: int, size: int, opt: OptimizerSettings | None = None,
                 weights: Callable[[], Sequence[Tensor]] | None = None) -> None:
        self.plan, self.method = plan, plan.method
        self.rule: Rule = make_rule(plan, plan.comm, opt)  # type: ignore[arg-type]
        """How the optimizer's update relates to the exchange (:mod:`hvdtrain.compression.rules`);
        where :attr:`Rule.updates`, :meth:`run` returns directions for plain SGD."""
        self.weights = weights
        """The parameters, in the gradients' order, where the rule adds weight decay itself."""
        self.unscaled_first = not plan.dense or self.rule.updates
        self.rank, self.size = rank, size
        self.step = 0
        """Optimizer steps exchanged so far; seeds random-k's indices and qsgd's noise."""
        self.slots = plan.slots() + self.rule.slots()
        self.store: Store = self._make_store(self.slots)
        self.stats = {"wire_bytes": 0.0, "dense_bytes": 0.0, "comm_s": 0.0, "compress_s": 0.0}
        """The last step's bytes handed to Horovod, the float32 bytes they stand for (both 0 when
        nothing was sent), the seconds waited for the collectives and the rest of the exchange's
        time (kernels, host draws)."""
        self._wire, self._waited = 0, 0.0
        self._gathered: tuple[int, dict[str, np.ndarray]] | None = None
        self._pending: dict[str, np.ndarray] = {}  # restored per-rank rows, until broadcast
        self._build()

    # framework hooks ---------------------------------------------------------------------------

    @abc.abstractmethod
    def _make_store(self, slots: list[state.Slot]) -> Store:
        """Storage for the slots, holding their initial values."""

    def _compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A stage function as the framework runs it (TensorFlow traces it)."""
        return fn

    @abc.abstractmethod
    def _tensor(self, array: np.ndarray) -> Tensor:
        """A host array as a framework tensor."""

    @abc.abstractmethod
    def _nbytes(self, tensors: Sequence[Tensor]) -> int:
        """Bytes of these tensors' contents."""

    @abc.abstractmethod
    def _collect(self, tag: str, gather: list[Tensor], mean: list[Tensor]
                 ) -> tuple[list[Tensor], list[Tensor]]:
        """Allgathers ``gather`` and averages ``mean`` over the ranks; returns when all are done."""

    @abc.abstractmethod
    def _allgather_rows(self, array: np.ndarray, name: str) -> np.ndarray:
        """Every rank's ``array`` as rows, in rank order (a collective)."""

    @abc.abstractmethod
    def _broadcast(self, array: np.ndarray, root_rank: int, name: str) -> np.ndarray:
        """The root's ``array`` on every rank (a collective; every rank passes the same shape)."""

    # the step ------------------------------------------------------------------------------------

    def _build(self) -> None:
        """Compiles the stages; they hold the world size, so :meth:`resize` builds them again."""
        self._begin_fn = self._compile(self._begin)
        self._advance_fns = [self._compile(self._round_function(r))
                             for r in range(1, self.plan.rounds + 1)]

    def _round_function(self, round_: int) -> Callable[..., Any]:
        return lambda got, carries, scalars, phase: self._advance(round_, got, carries, scalars,
                                                                  phase)

    def resize(self, rank: int, size: int, accumulation: int = 1) -> None:
        """Continues as ``rank`` of ``size`` ranks (accumulation does not matter: the exchange
        runs once per step); this rank keeps its residuals until a :meth:`broadcast` of restored
        state re-shards them."""
        if (rank, size) != (self.rank, self.size):
            self.rank, self.size = rank, size
            self._build()

    def run_length(self, total_steps: int) -> None:
        """The run's length: the dense start, where ``comm.dense_steps`` is -1, is
        ``comm.dense_fraction`` of it, at least ``comm.dense_min_steps``
        (:func:`hvdtrain.compression.rules.dense_start`)."""
        self.rule.run_length(total_steps)

    def run(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """The average over the ranks of each gradient (one per shape, in the plan's order)."""
        self.step += 1
        self._wire, self._waited = 0, 0.0
        start = time.perf_counter()
        out = self._exchange(list(grads))
        self._adapt(grads)
        compress_s = time.perf_counter() - start - self._waited
        dense = float(self.plan.dense_bytes()) if self._wire else 0.0
        self.stats = {"wire_bytes": float(self._wire), "dense_bytes": dense,
                      "comm_s": self._waited, "compress_s": compress_s}
        return out

    def _adapt(self, grads: Sequence[Tensor]) -> None:
        """The adaptive rule's bookkeeping after a step: this rank's gradient norm and, at the end
        of an interval, the ranks' mean norm (allgathered, so the same on every rank) decides
        the level of the steps that follow."""
        accordion = self.rule.accordion
        if accordion is None:
            return
        accordion.add(self.kernels.sqrt(self.kernels.square_sum(list(grads))))
        if accordion.due(self.step):
            rows = self._allgather_rows(np.array([accordion.local_mean()], np.float64),
                                        "hvdtrain.exchange.accordion.norm")
            accordion.decide(float(rows.mean()))

    def note_fused(self, comm_s: float) -> None:
        """A dense plan's step that the framework traced into its step function: counted (the
        checkpoint carries the step count, whichever path ran) and measured as :meth:`run` would."""
        if not self.plan.dense:
            raise NotImplementedError(f"{self.method} sends compressed tensors: it cannot be fused")
        self.step += 1
        sent = self.size > 1
        self.stats = {"wire_bytes": float(self.plan.wire_bytes()) if sent else 0.0,
                      "dense_bytes": float(self.plan.dense_bytes()) if sent else 0.0,
                      "comm_s": comm_s, "compress_s": 0.0}

    def _exchange(self, grads: list[Tensor]) -> list[Tensor]:
        if self.plan.dense and self.size == 1:
            return grads  # nothing to average and nothing sent, as Horovod's optimizers at size 1
        # The stages get the step's phase (a Python value: TensorFlow traces once per phase) and
        # its numbers (tensors), never the step itself.
        phase = self.rule.begin_step(self.step)
        scalars = {name: self._tensor(np.array(value, np.float32))
                   for name, value in self.rule.scalars(self.step).items()}
        host = [self._host(t, phase) for t in self.plan.tensors]
        sends, carries = self._begin_fn(grads, host, scalars, phase)
        for round_, advance in enumerate(self._advance_fns, start=1):
            sends, carries = advance(self._send(f"{self.method}.{round_}", sends), carries,
                                     scalars, phase)
        return [average for _, _, average in carries]

    def _host(self, t: TensorPlan, phase: Phase) -> Any:
        draw = (self.plan.host(t, self.step, self.rank) if self._compressed(t, phase) else None)
        return () if draw is None else self._tensor(draw)

    def _context(self, scalars: Scalars, phase: Phase) -> Context:
        weights = list(self.weights()) if self.weights is not None else None
        return Context(self.kernels, self.store, self.size, phase.feedback, weights, scalars)

    @staticmethod
    def _compressed(t: TensorPlan, phase: Phase) -> bool:
        """Whether ``t`` is compressed this step (a rule's warm-up sends every tensor dense)."""
        return t.compressed and not phase.dense

    def _begin(self, grads: list[Tensor], host: list[Any], scalars: Scalars, phase: Phase
               ) -> tuple[list[Message], list[Carry]]:
        """Stage 0 of every tensor."""
        k, ctx = self.kernels, self._context(scalars, phase)
        flats = self.rule.prepare(ctx, [k.flat(g) for g in grads])
        sends: list[Message] = []
        carries: list[Carry] = []
        for t, flat, draw in zip(self.plan.tensors, flats, host, strict=True):
            if not self._compressed(t, phase):
                dtype = self.plan.dense_dtype if not t.compressed else "float32"
                sends.append(Message(mean=(k.cast(flat, dtype),)))
                carries.append(((), (), ()))
                continue
            residual = self.store.read(slot_key(RESIDUAL, t.index)) if ctx.feedback else None
            acc = ref.error_feedback(self.rule.accumulate(ctx, t, flat), residual)
            stage = self.plan.start(ctx, t, acc, draw)
            self._keep(ctx, t, acc, stage)
            self.rule.sent(ctx, t, stage)
            sends.append(stage.send)
            carries.append((acc if ctx.feedback else (), stage.carry, ()))
        return sends, carries

    def _advance(self, round_: int, got: list[Message], carries: list[Carry], scalars: Scalars,
                 phase: Phase) -> tuple[list[Message], list[Carry]]:
        """Stage ``round_`` of every tensor still under way."""
        k, ctx = self.kernels, self._context(scalars, phase)
        sends: list[Message] = []
        out: list[Carry] = []
        for t, message, (acc, carry, average) in zip(self.plan.tensors, got, carries, strict=True):
            if not isinstance(average, tuple):  # finished in an earlier round
                stage = Stage(out=average)
            elif not self._compressed(t, phase):
                mean = k.cast(message.mean[0], "float32")
                result = self.rule.finish(ctx, t, mean, False)
                stage = Stage(out=k.reshape(result, t.shape))
            else:
                stage = self.plan.advance(ctx, t, round_, message, carry)
                self._keep(ctx, t, acc, stage)
                if stage.out is not None:
                    result = self.rule.finish(ctx, t, stage.out, True)
                    stage = stage._replace(out=k.reshape(result, t.shape))
            sends.append(stage.send)
            out.append((acc, stage.carry, () if stage.out is None else stage.out))
        return sends, out

    def _keep(self, ctx: Context, t: TensorPlan, acc: Tensor, stage: Stage) -> None:
        """Error feedback: what this rank did not send waits for the next step."""
        if ctx.feedback and stage.sent is not None:
            self.store.write(slot_key(RESIDUAL, t.index), ref.new_residual(acc, stage.sent))

    def _send(self, tag: str, sends: list[Message]) -> list[Message]:
        """One round's collectives for all tensors, counted and timed; the results per tensor."""
        gather = [x for m in sends for x in m.gather]
        mean = [x for m in sends for x in m.mean]
        self._wire += self._nbytes(gather) + self._nbytes(mean)
        start = time.perf_counter()
        try:
            gathered, averaged = self._collect(tag, gather, mean)
        finally:
            self._waited += time.perf_counter() - start
        g, a = iter(gathered), iter(averaged)
        return [Message(tuple(next(g) for _ in m.gather), tuple(next(a) for _ in m.mean))
                for m in sends]

    # state ---------------------------------------------------------------------------------------

    def gather(self) -> None:
        """Collects every rank's residuals on every rank for :meth:`state_dict` (a collective: every
        rank calls it before rank 0 writes a checkpoint)."""
        rows = {s.key: self._allgather_rows(self.store.numpy(s.key),
                                            f"hvdtrain.exchange.gather.{s.key}")
                for s in self.slots if s.per_rank}
        self._gathered = (self.step, rows)

    def state_dict(self) -> dict[str, np.ndarray]:
        """The checkpoint entry (:func:`hvdtrain.compression.state.pack`): method, step, ``Q`` and
        every rank's residuals as rows by rank.

        Residuals come from a :meth:`gather` at this step; without one (an elastic commit before
        any step) only this rank's are known, and at more than one rank they are left out rather
        than handed to every rank on restore.
        """
        arrays = {s.key: self.store.numpy(s.key) for s in self.slots if not s.per_rank}
        if self._gathered is not None and self._gathered[0] == self.step:
            arrays |= self._gathered[1]
        elif self.size == 1:
            arrays |= {s.key: self.store.numpy(s.key)[None] for s in self.slots if s.per_rank}
        if self.rule.accordion is not None:
            arrays[ACCORDION] = self.rule.accordion.state()
        return state.pack(self.method, self.step, arrays)

    def load_state_dict(self, entry: Mapping[str, Any] | None, where: str) -> None:
        """Restores :meth:`state_dict`'s entry (``where`` names its file in errors); None or empty:
        nothing to restore. Every rank that reads it takes its own row of residuals at once;
        :meth:`broadcast` then serves the ranks that did not read it."""
        if not entry:
            return
        saved = state.unpack(entry, self.method, self.slots, where)
        self.step = saved.step
        if self.rule.accordion is not None and ACCORDION in entry:
            self.rule.accordion.load(np.asarray(entry[ACCORDION]))
        for key, value in saved.shared.items():
            self.store.assign(key, value)
        self._pending = saved.rows
        for key, rows in saved.rows.items():
            self.store.assign(key, state.reshard(rows, self.size)[self.rank])

    def broadcast(self, root_rank: int = 0) -> None:
        """Gives every rank the root's step and ``Q`` and, after a restore on the root, its own
        row of the restored residuals at the current world size (a collective)."""
        head = self._broadcast(np.array([self.step, int(bool(self._pending))], np.int64),
                               root_rank, "hvdtrain.exchange.head")
        self.step = int(head[0])
        if self.rule.accordion is not None:  # the root's switch, so that every rank's agrees
            self.rule.accordion.load(self._broadcast(self.rule.accordion.state(), root_rank,
                                                     "hvdtrain.exchange.accordion"))
        for s in self.slots:
            name = f"hvdtrain.exchange.{s.key}"
            if not s.per_rank:
                self.store.assign(s.key, self._broadcast(self.store.numpy(s.key), root_rank, name))
            elif head[1]:
                rows = self._pending.get(s.key)
                table = (state.reshard(rows, self.size) if rows is not None
                         else np.zeros((self.size, s.initial.size), np.float32))
                self.store.assign(s.key, self._broadcast(table, root_rank, name)[self.rank])
        self._pending = {}
