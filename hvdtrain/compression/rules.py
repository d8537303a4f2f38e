"""Update rules of the compressing exchange: plain averaging, DGC for momentum SGD, compressed
Adam; framework-free, written once against :class:`~hvdtrain.compression.kernels.Kernels`.

A rule decides what a compressed tensor's stage 0 compresses and what the exchange returns. Plain
averaging (:class:`Rule`) compresses the gradient and returns the mean gradient, which the
framework's optimizer applies. :class:`DGC` and :class:`CompressedAdam` apply the optimizer's
momentum (and Adam's variance) inside the exchange, so they return an update *direction*, and the
framework swaps its optimizer for plain SGD (no momentum, no decay) that applies it:
``w -= lr d``. The math is in
:mod:`hvdtrain.compression.reference`'s docstring ("Update rules").

The step schedule, one for every method and rule (docs/compression.md, "Dense start"): steps
1 to ``comm.dense_steps`` (by default ``comm.dense_fraction`` of the run's steps, at least
``comm.dense_min_steps``, resolved by :func:`dense_start` when the trainer tells the exchange
the run's length) average every tensor dense (float32) and keep no error feedback, so
PowerSGD's warm-started ``Q`` and every residual begin at step ``dense_steps + 1`` (torch's
``start_powerSGD_iter``); compressed Adam estimates its variance over those steps (its dense
warm-up) and DGC's density warm-up runs over the ``sparsity_warmup_steps`` steps after them.

A rule's stages never read the step number itself: what changes the shape of a step's work (the
dense start, the density warm-up's ratio) is its :class:`Phase`, and the numbers that change
every step (Adam's bias corrections) are :meth:`Rule.scalars`, handed to the stages as tensors.
So a framework that traces the stages (TensorFlow) traces once per phase, not once per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from hvdtrain.compression import reference as ref
from hvdtrain.compression.kernels import Context, Tensor
from hvdtrain.compression.plans import Plan, Stage, TensorPlan
from hvdtrain.compression.state import MOMENTUM, RESIDUAL, VARIANCE, VELOCITY, Slot, slot_key
from hvdtrain.strategies.comm import adam_misfit, dgc_misfit


class RuleSettings(Protocol):
    """The ``comm`` settings a rule reads (:class:`hvdtrain.config.CommConfig` has them)."""

    compression: str
    ratio: float
    error_feedback: bool
    momentum_correction: bool
    momentum_masking: bool
    clip_norm: float
    sparsity_warmup_steps: int
    compress_momentum: bool
    dense_steps: int
    dense_fraction: float
    dense_min_steps: int
    rank: int
    adaptive: bool
    adaptive_interval: int
    adaptive_threshold: float
    adaptive_factor: int


@dataclass(frozen=True)
class OptimizerSettings:
    """What a rule needs of the run's optimizer (each framework reads it from its own)."""

    name: str
    """``sgd``, ``adam`` or ``adamw``."""
    momentum: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8


class Phase(NamedTuple):
    """What a step's stages depend on besides their tensors (hashable: a trace key)."""

    ratio: float | None
    """The fraction sparse methods send (:attr:`hvdtrain.compression.plans.Plan.ratio`)."""
    dense: bool
    """Whether every tensor travels dense (float32) this step."""
    feedback: bool
    """Whether compressed tensors keep error-feedback residuals this step."""
    rank: int | None = None
    """PowerSGD's rank (:attr:`hvdtrain.compression.plans.Plan.rank`)."""


class Accordion:
    """Accordion's switch between two compression levels (Agarwal et al., MLSys 2021).

    Over each interval of ``interval`` steps every rank sums its local gradient's L2 norm
    (:meth:`add`, a framework scalar: no host sync per step); at the interval's end the exchange
    averages the ranks' means (an allgather of one number: every rank then holds the same value
    and takes the same decision, :meth:`decide`). Where that norm changed by at least
    ``threshold`` of the previous interval's, training is in a critical regime and the next
    interval compresses less (:attr:`low`); else it compresses as configured. The first interval,
    with no previous norm, compresses less, as Accordion starts. (Accordion compares the norm of
    the gradient accumulated over an epoch; this compares the mean of the steps' norms, which
    needs no model-sized accumulator.)
    """

    def __init__(self, interval: int, threshold: float) -> None:
        self.interval, self.threshold = interval, threshold
        self.low = True
        """Whether the exchange compresses less (the low compression level) now."""
        self.previous = -1.0  # the last interval's norm over the ranks; -1: none yet
        self.total: Any = 0.0  # this rank's sum of norms in the interval (a framework scalar)
        self.count = 0

    def add(self, norm: Any) -> None:
        """Takes this rank's local gradient norm of a step (a framework scalar)."""
        self.total = self.total + norm
        self.count += 1

    def due(self, step: int) -> bool:
        """Whether ``step`` ends an interval (the exchange then calls :meth:`decide`)."""
        return step % self.interval == 0 and self.count > 0

    def local_mean(self) -> float:
        """This rank's mean norm over the interval."""
        return float(self.total) / self.count

    def decide(self, norm: float) -> None:
        """The interval's norm over the ranks (the same on every rank): the next level."""
        if self.previous >= 0.0:
            self.low = abs(norm - self.previous) >= self.threshold * self.previous
        self.previous, self.total, self.count = norm, 0.0, 0

    def state(self) -> np.ndarray:
        """What a checkpoint keeps (float64): the level, the previous norm, the running sum."""
        return np.array([float(self.low), self.previous, float(self.total), self.count],
                        np.float64)

    def load(self, array: np.ndarray) -> None:
        """Restores :meth:`state`'s array."""
        low, self.previous, self.total, count = (float(x) for x in np.asarray(array))
        self.low, self.count = bool(low), int(count)


def dense_start(dense_steps: int, dense_fraction: float, dense_min_steps: int,
                total_steps: int) -> int:
    """The dense start's steps, the one rule that training in both frameworks and ``hvdtrain
    plan`` apply: ``dense_steps`` where it is set (0 or more); else (-1) the larger of the
    ``dense_fraction`` of the run's ``total_steps``, rounded up (so any fraction above 0 gives at
    least one dense step: compressed Adam needs one to estimate its variance), and the floor
    ``dense_min_steps``, capped at the run's length. The floor keeps a short run from starting
    the method before training has settled (docs/compression.md, "Dense start"); from
    ``dense_min_steps / dense_fraction`` steps on (1,000 with the defaults) the fraction alone
    decides."""
    if dense_steps >= 0:
        return dense_steps
    share = math.ceil(dense_fraction * total_steps - 1e-9)
    return min(total_steps, max(share, dense_min_steps))


ACCORDION = "accordion"
"""The adaptive rule's entry in a checkpoint's compression state (not a slot: host numbers)."""


class Rule:
    """Plain averaging: compress the gradient (plus its residual), return the mean gradient."""

    updates = False
    """Whether the exchange returns an update direction that plain SGD applies."""

    def __init__(self, plan: Plan, comm: RuleSettings, opt: OptimizerSettings) -> None:
        self.plan, self.comm, self.opt = plan, comm, opt
        self.dense_steps = max(comm.dense_steps, 0)
        """Steps 1 to this average dense: ``comm.dense_steps``, or, where that is -1, 0 until
        :meth:`run_length` resolves ``comm.dense_fraction`` of the run's steps (at least
        ``comm.dense_min_steps``)."""
        self.accordion = (Accordion(comm.adaptive_interval, comm.adaptive_threshold)
                          if comm.adaptive and not plan.dense and not self.updates else None)
        """The adaptive rule (``comm.adaptive``), which the exchange shows every step's local
        gradient norm; None: the configured level throughout."""

    def slots(self) -> list[Slot]:
        """State the rule keeps beside the plan's."""
        return []

    def feedback(self, step: int) -> bool:
        """Whether compressed tensors keep error-feedback residuals at ``step``."""
        return self.plan.uses_feedback

    def run_length(self, total_steps: int) -> None:
        """The run ends at step ``total_steps`` (the same on every rank): resolves the dense
        start (:func:`dense_start`)."""
        self.dense_steps = dense_start(self.comm.dense_steps, self.comm.dense_fraction,
                                       self.comm.dense_min_steps, total_steps)

    def dense_now(self, step: int) -> bool:
        """Whether every tensor travels dense (float32) at ``step``: the dense start, steps 1 to
        :attr:`dense_steps`."""
        return step <= self.dense_steps

    def begin_step(self, step: int) -> Phase:
        """Host-side preparation of ``step`` (before any stage); its phase."""
        if self.accordion is not None:  # the low compression level sends factor times more
            low, c = self.accordion.low, self.comm
            self.plan.ratio = min(1.0, c.ratio * c.adaptive_factor) if low else None
            self.plan.rank = c.rank * c.adaptive_factor if low else None
        return Phase(self.plan.ratio, self.dense_now(step), self.feedback(step), self.plan.rank)

    def scalars(self, step: int) -> dict[str, float]:
        """The numbers of ``step`` that the stages read from :attr:`Context.scalars`."""
        return {}

    def prepare(self, ctx: Context, grads: list[Tensor]) -> list[Tensor]:
        """The flat local gradients as the rule uses them (L2 decay: ``g + wd w``)."""
        decay = self.opt.weight_decay if self.updates and self.opt.name != "adamw" else 0.0
        if decay and ctx.weights is not None:
            return [g + ctx.kernels.flat(w) * decay
                    for g, w in zip(grads, ctx.weights, strict=True)]
        return grads

    def accumulate(self, ctx: Context, t: TensorPlan, flat: Tensor) -> Tensor:
        """What compressed tensor ``t`` compresses (before its residual is added)."""
        return flat

    def sent(self, ctx: Context, t: TensorPlan, stage: Stage) -> None:
        """After stage 0 of compressed tensor ``t`` chose what to send."""

    def finish(self, ctx: Context, t: TensorPlan, mean: Tensor, compressed: bool) -> Tensor:
        """What the exchange returns for ``t`` from the flat mean over the ranks."""
        return mean


class DGC(Rule):
    """Deep Gradient Compression (Lin et al., 2018) for momentum SGD: momentum correction, local
    gradient clipping, momentum factor masking and a density warm-up."""

    updates = True

    def slots(self) -> list[Slot]:
        zeros = [(t, np.zeros(t.size, np.float32)) for t in self.plan.tensors]
        return ([Slot(VELOCITY, t.index, z) for t, z in zeros if t.compressed]
                + [Slot(MOMENTUM, t.index, z) for t, z in zeros if not t.compressed])

    def feedback(self, step: int) -> bool:
        return True

    def begin_step(self, step: int) -> Phase:
        # The density warm-up starts where the dense start ends.
        self.plan.ratio = ref.warmup_ratio(self.comm.ratio, step - self.dense_steps,
                                           self.comm.sparsity_warmup_steps)
        return super().begin_step(step)

    def prepare(self, ctx: Context, grads: list[Tensor]) -> list[Tensor]:
        grads = super().prepare(ctx, grads)
        if self.comm.clip_norm > 0:  # DGC's local threshold: the global one over sqrt(ranks)
            factor = ctx.kernels.clip_factor(grads, self.comm.clip_norm / math.sqrt(ctx.size))
            grads = [g * factor for g in grads]
        return grads

    def accumulate(self, ctx: Context, t: TensorPlan, flat: Tensor) -> Tensor:
        key = slot_key(VELOCITY, t.index)
        velocity = ctx.store.read(key) * self.opt.momentum + flat
        ctx.store.write(key, velocity)
        return velocity

    def sent(self, ctx: Context, t: TensorPlan, stage: Stage) -> None:
        if self.comm.momentum_masking and stage.picked is not None:
            key = slot_key(VELOCITY, t.index)
            ctx.store.write(key, ctx.kernels.zero_at(ctx.store.read(key), stage.picked))

    def finish(self, ctx: Context, t: TensorPlan, mean: Tensor, compressed: bool) -> Tensor:
        if compressed:
            return mean  # the velocity was applied before compression
        # Dense: momentum on the average. A compressed tensor in the dense start keeps it in its
        # velocity slot, which then holds the same velocity on every rank when compression starts.
        key = slot_key(VELOCITY if t.compressed else MOMENTUM, t.index)
        velocity = ctx.store.read(key) * self.opt.momentum + mean
        ctx.store.write(key, velocity)
        return velocity


class CompressedAdam(Rule):
    """Adam and AdamW with compressed momentum after a dense warm-up (1-bit Adam, 0/1 Adam): the
    dense start, :attr:`Rule.dense_steps` (at least 1 with this rule), is that warm-up."""

    updates = True

    def slots(self) -> list[Slot]:
        out = [Slot(kind, t.index, np.zeros(t.size, np.float32))
               for t in self.plan.tensors for kind in (MOMENTUM, VARIANCE)]
        if not self.plan.uses_feedback:  # error compensation whatever the method
            out += [Slot(RESIDUAL, t.index, np.zeros(t.size, np.float32))
                    for t in self.plan.tensors if t.compressed]
        return out

    def feedback(self, step: int) -> bool:
        return not self.dense_now(step)

    def scalars(self, step: int) -> dict[str, float]:
        """Adam's bias corrections of ``step``: ``1 / (1 - b1^step)`` and ``1 / (1 - b2^step)``."""
        o = self.opt
        return {"m_scale": 1.0 / (1.0 - o.beta1 ** step), "v_scale": 1.0 / (1.0 - o.beta2 ** step)}

    def accumulate(self, ctx: Context, t: TensorPlan, flat: Tensor) -> Tensor:
        b1 = self.opt.beta1
        return ctx.store.read(slot_key(MOMENTUM, t.index)) * b1 + flat * (1.0 - b1)

    def frozen_variance(self, ctx: Context, t: TensorPlan, m: Tensor) -> Tensor:
        """The variance of compressed tensor ``t`` after the warm-up, given its new shared momentum.

        An entry whose gradient was exactly 0 through the whole warm-up has no variance to freeze
        (``v = 0``), and its direction would be ``m / eps`` once its gradient turns nonzero. Such an
        entry freezes later instead: at the first step whose exchanged gradient ``g`` (the shared
        momentum's increment, ``(m - b1 m_old) / (1 - b1)``, the same on every rank) is nonzero,
        it takes Adam's first update, ``v = (1 - b2) g^2``, and keeps it. Entries with a variance
        keep theirs.
        """
        o, v_key = self.opt, slot_key(VARIANCE, t.index)
        grad = (m - ctx.store.read(slot_key(MOMENTUM, t.index)) * o.beta1) * (1.0 / (1.0 - o.beta1))
        v = ctx.kernels.fill_zeros(ctx.store.read(v_key), grad * grad * (1.0 - o.beta2))
        ctx.store.write(v_key, v)
        return v

    def finish(self, ctx: Context, t: TensorPlan, mean: Tensor, compressed: bool) -> Tensor:
        o, m_key, v_key = self.opt, slot_key(MOMENTUM, t.index), slot_key(VARIANCE, t.index)
        scalars = ctx.scalars or {}
        if compressed:  # the mean of the ranks' compressed momenta; the variance stays frozen
            m, v = mean, self.frozen_variance(ctx, t, mean)
            v_scale: Tensor = 1.0 / (1.0 - o.beta2 ** max(self.dense_steps, 1))
        else:
            m = ctx.store.read(m_key) * o.beta1 + mean * (1.0 - o.beta1)
            v = ctx.store.read(v_key) * o.beta2 + mean * mean * (1.0 - o.beta2)
            ctx.store.write(v_key, v)
            v_scale = scalars["v_scale"]
        ctx.store.write(m_key, m)
        m_hat = m * scalars["m_scale"]
        direction = m_hat / (ctx.kernels.sqrt(v * v_scale) + o.eps)
        if o.name == "adamw" and o.weight_decay and ctx.weights is not None:
            # Decoupled decay: w -= lr (d + wd w) is AdamW's update exactly. Here, not as the SGD
            # step's weight_decay: Horovod's broadcast_optimizer_state steps a stateless optimizer
            # once with zero gradients, which would decay the weights an extra time on resume.
            direction = direction + ctx.kernels.flat(ctx.weights[t.index]) * o.weight_decay
        return direction


def make_rule(plan: Plan, comm: RuleSettings, opt: OptimizerSettings | None) -> Rule:
    """The rule for this plan and optimizer (None: the framework keeps its optimizer).

    DGC and compressed Adam where :mod:`hvdtrain.strategies.comm` says they run; the config
    refuses a rule turned on where they do not (:func:`~hvdtrain.strategies.comm.check_comm`),
    so plain averaging here means the config asked for it. Code that builds an exchange itself
    may turn both rules on: the optimizer picks one."""
    if opt is None:
        return Rule(plan, comm, OptimizerSettings("sgd"))
    feedback = comm.error_feedback
    if comm.momentum_correction and not dgc_misfit(plan.method, feedback, opt.name, opt.momentum):
        return DGC(plan, comm, opt)
    if comm.compress_momentum and not adam_misfit(plan.method, feedback, opt.name):
        return CompressedAdam(plan, comm, opt)
    return Rule(plan, comm, opt)
