"""The ``pipeline`` section's own values: the pipeline schedules and what each accepts, checked
against the config before anything starts (:func:`check_pipeline_section`). It sits beside the
pipeline strategy (:mod:`hvdtrain.strategies.pipeline`, its row of the compatibility table), so
that :mod:`hvdtrain.config` checks the section without importing :mod:`hvdtrain.pipeline`; the
pipeline package reads the table from here (:mod:`hvdtrain.pipeline.schedules` re-exports it).

One table (:data:`SCHEDULES`) says, per ``pipeline.schedule``: which frameworks run it, how many
model pieces a rank holds (``pipeline.virtual_stages``), which rank holds which piece, and the
micro-batch counts it accepts. The limits are those of ``torch.distributed.pipelining`` 2.13 (its
schedules raise on them after the process groups exist, where a mistake would leave the other
ranks waiting); the TensorFlow engine runs the schedules written once in the core under the same
names and limits.

Bubble, the fraction of a step a stage idles (``P`` stages, ``m`` micro-batches, ``v`` pieces per
rank): GPipe and 1F1B ``(P-1)/(m+P-1)``, 1F1B holding at most ``P`` micro-batches' activations
where GPipe holds ``m``; interleaved 1F1B ``(P-1)/(v*m)`` for ``v`` times the stage-to-stage
traffic (Megatron); the zero-bubble schedules split the backward pass to fill the rest (Qi et al.
2023; experimental in PyTorch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hvdtrain.configcheck import refuse_unread, shown
from hvdtrain.errors import ConfigError
from hvdtrain.strategies.pipeline import schedule_refused


@dataclass(frozen=True)
class Schedule:
    """What one ``pipeline.schedule`` accepts and how it places the model's pieces."""

    name: str
    torch_class: str
    """The class in ``torch.distributed.pipelining.schedules``."""
    frameworks: tuple[str, ...]
    virtual: tuple[int, int | None]
    """The allowed ``pipeline.virtual_stages`` (pieces per rank): least and most (None: no most)."""
    style: str
    """How pieces go to the ranks of a pipeline: ``loop`` (piece ``i`` on rank ``i % P``) or ``v``
    (pieces ``r`` and ``2P-1-r`` on rank ``r``: the first and last piece share a rank)."""
    min_microbatches: str
    """``one``, ``ranks`` (at least ``P``) or ``pieces`` (at least ``P*v``)."""
    rounds: bool = False
    """Whether ``m`` must be a multiple of ``max(1, m // P)`` (torch's interleaved rounds)."""
    experimental: bool = False
    refused: str = ""
    """Why the config refuses this schedule with stages (empty: it runs)."""

    def pieces_of(self, pipe_rank: int, stages: int, virtual: int) -> list[int]:
        """The global indices of the pieces (torch's stage indices) that ``pipe_rank`` of a
        pipeline of ``stages`` ranks holds, in increasing order."""
        if self.style == "v":
            return [pipe_rank, 2 * stages - 1 - pipe_rank]
        return [pipe_rank + k * stages for k in range(virtual)]

    def holder(self, piece: int, stages: int) -> int:
        """The rank of a pipeline (0 to ``stages - 1``) that holds piece ``piece``: piece 0's
        holder reads the inputs, the last piece's reads the targets and computes the loss."""
        if self.style == "v":
            return piece if piece < stages else 2 * stages - 1 - piece
        return piece % stages

    def bubble(self, stages: int, microbatches: int, virtual: int = 1) -> float:
        """The idle fraction of a step that theory gives for this schedule (zero-bubble schedules:
        the 1F1B figure, their upper bound)."""
        if virtual > 1 and self.style == "loop":
            return (stages - 1) / (virtual * microbatches + stages - 1)
        return (stages - 1) / (microbatches + stages - 1)


_BOTH = ("torch", "tensorflow")
_TORCH = ("torch",)
_V_EVAL = ("torch.distributed.pipelining 2.13 cannot evaluate with this schedule (its eval() runs "
           "a backward action); use interleaved_zero_bubble or interleaved_1f1b")

SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", "ScheduleGPipe", _BOTH, (1, 1), "loop", "one"),
    Schedule("1f1b", "Schedule1F1B", _BOTH, (1, 1), "loop", "ranks"),
    # The TensorFlow stages run the core's action lists, written for one piece a rank.
    Schedule("interleaved_1f1b", "ScheduleInterleaved1F1B", _TORCH, (2, None), "loop", "one",
             rounds=True),
    Schedule("interleaved_zero_bubble", "ScheduleInterleavedZeroBubble", _TORCH, (2, None), "loop",
             "one", rounds=True, experimental=True),
    # The V schedules train, but torch 2.13's eval() of them runs a backward action and raises
    # ("can't steal_bwd_input if this stage doesn't have backward") at the first evaluation.
    Schedule("zbv_zero_bubble", "ScheduleZBVZeroBubble", _TORCH, (2, 2), "v", "ranks",
             experimental=True, refused=_V_EVAL),
    Schedule("dualpipev", "ScheduleDualPipeV", _TORCH, (2, 2), "v", "pieces", experimental=True,
             refused=_V_EVAL),
)}
"""Every ``pipeline.schedule``, by name."""

SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULES)
"""The ``pipeline.schedule`` values, in the order they are documented."""


def microbatch_count(stages: int, microbatches: int, virtual: int) -> int:
    """``pipeline.microbatches`` resolved: 0 means one per piece of the model (``P*v``), the
    fewest that every schedule accepts."""
    return microbatches or stages * virtual


def check_pipeline(*, stages: int, microbatches: int, schedule: str, virtual_stages: int,
                   split: str | list, framework: str) -> int:
    """Raises a one-line :class:`ConfigError` for a ``pipeline`` section that no schedule runs;
    returns the micro-batch count (:func:`microbatch_count`). Without stages only the schedule's
    own ``virtual_stages`` is checked. The world size is checked at launch
    (:class:`hvdtrain.layout.Layout`); what spans other sections, in
    :func:`check_pipeline_section`."""
    plan = SCHEDULES[schedule]
    _check_virtual(plan, virtual_stages)
    m = microbatch_count(stages, microbatches, virtual_stages)
    if stages > 1:
        _check_framework(plan, framework)
        if plan.refused:
            raise ConfigError(f"pipeline.schedule={schedule!r}: {plan.refused}")
        _check_microbatches(plan, stages, virtual_stages, m)
        _check_split(split, stages * virtual_stages)
    return m


def check_pipeline_section(cfg: Any) -> None:
    """The ``pipeline`` section of a config (:class:`hvdtrain.config.Config`) against the
    schedules and the rest of ``cfg``: a one-line :class:`ConfigError` for what cannot run or
    would do nothing (see docs/pipeline.md). What stages do not compose with is in the
    compatibility table (:mod:`hvdtrain.strategies.pipeline`)."""
    pipe = cfg.pipeline
    if pipe.stages == 1:  # before the schedules' checks: they would ask for more of the same
        refuse_unread("pipeline.", pipe, ["microbatches", "schedule", "virtual_stages", "split"],
                      "pipeline.stages=1", "without stages every rank trains the whole model",
                      "pipeline.stages to 2 or more")
    m = check_pipeline(stages=pipe.stages, microbatches=pipe.microbatches, schedule=pipe.schedule,
                       virtual_stages=pipe.virtual_stages, split=pipe.split,
                       framework=cfg.framework)
    if pipe.stages == 1:
        return
    for key in ("batch_size", "eval_batch_size"):
        size = getattr(cfg.data, key)
        if size % m:
            raise ConfigError(f"data.{key}={size}: with pipeline stages it is the batch of one "
                              f"pipeline copy, split into pipeline.microbatches={m}: must be a "
                              "multiple of it")


def _check_virtual(schedule: Schedule, virtual: int) -> None:
    least, most = schedule.virtual
    if virtual < least or (most is not None and virtual > most):
        wanted = f"exactly {least}" if least == most else (
            f"at least {least}" if most is None else f"{least} to {most}")
        raise ConfigError(f"pipeline.virtual_stages={virtual}: schedule {schedule.name} needs "
                          f"{wanted} model pieces per rank")


def _check_framework(schedule: Schedule, framework: str) -> None:
    # Checked here, before the schedule's other checks; the reason is the compatibility table's.
    if framework not in schedule.frameworks:
        raise ConfigError(schedule_refused(schedule.name, framework))


def _check_microbatches(schedule: Schedule, stages: int, virtual: int, m: int) -> None:
    least = {"one": 1, "ranks": stages, "pieces": stages * virtual}[schedule.min_microbatches]
    if m < least:
        raise ConfigError(f"pipeline.microbatches={m}: schedule {schedule.name} needs at least "
                          f"{least} with {stages} stages x {virtual} virtual")
    rounds = max(1, m // stages)
    if schedule.rounds and m % rounds:
        raise ConfigError(f"pipeline.microbatches={m}: schedule {schedule.name} needs a multiple "
                          f"of its rounds, max(1, microbatches // stages) = {rounds} (e.g. "
                          f"{rounds * stages})")


def _check_split(split: str | list, pieces: int) -> None:
    if isinstance(split, str):
        if split != "auto":
            raise ConfigError(f"pipeline.split={shown(split)}: expected auto or a list of the layers "
                              "(indices or names) where stages 2, 3, ... begin")
        return
    if len(split) != pieces - 1:
        raise ConfigError(f"pipeline.split={shown(split)}: {pieces} pieces need {pieces - 1} "
                          "layer(s) where the pieces after the first begin")
    for item in split:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise ConfigError(f"pipeline.split={shown(split)}: {shown(item)} is neither a layer index nor "
                              "a layer name")
