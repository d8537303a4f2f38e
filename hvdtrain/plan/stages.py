"""Pipeline stages as the planner prices them: the split of the layers (the same balanced split as
``pipeline.split: auto``), each micro-batch's slowest stage with its stage-to-stage transfer, and
the step's span from the schedules' own simulator (:func:`hvdtrain.pipeline.actions.simulate`),
whose bubble is GPipe's ``(P-1)/(m+P-1)`` for balanced stages, or for the PyTorch engine, whose
sends do not wait, from :func:`hvdtrain.pipeline.actions.simulate_unblocked` over the orders
``torch.distributed.pipelining`` runs. Interleaved 1F1B, which the
simulator does not run, is priced by Megatron's account of it (:func:`interleaved_step`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from hvdtrain.pipeline.actions import actions, simulate, simulate_unblocked, unblocked_actions
from hvdtrain.pipeline.split import balanced_bounds
from hvdtrain.plan.profile import LayerProfile

SIMULATED = ("1f1b", "gpipe")
"""The schedules written as action lists for the simulator."""
PLANNED_SCHEDULES = (*SIMULATED, "interleaved_1f1b")
"""The schedules the planner prices (the zero-bubble ones not: their backward pass splits in two,
which the profile does not time apart)."""
DEFAULT_VIRTUAL = 2
"""Pieces per rank the plan prices interleaved 1F1B with when the config does not say."""


@dataclass(frozen=True)
class PipelineStep:
    """One pipeline copy's step: the span of the schedule, its bubble, per-stage parameter bytes."""

    span_s: float
    bubble: float
    """The idle share of the stages' time: with unblocked messages, the waits for them too."""
    forward_s: float
    """The slowest stage's forward pass of one micro-batch, its transfer included where messages
    block."""
    backward_s: float
    stage_bytes: list[int]
    transfer_s: float
    """One micro-batch's activation (or its gradient) over the slowest cut."""
    busy_s: float
    """The slowest stage's computing (and blocking transfers) over the step: ``m (f + b)``."""


def split_layers(layers: list[LayerProfile], stages: int) -> list[list[LayerProfile]]:
    """The layers cut into ``stages`` pieces as ``pipeline.split: auto`` cuts them."""
    bounds = balanced_bounds([max(1, x.params) for x in layers], stages)
    return [layers[a:b] for a, b in itertools.pairwise(bounds)]


def pipeline_step(layers: list[LayerProfile], stages: int, micro: int, schedule: str,
                  share: float, byte_scale: float, transfer: Callable[[float], float],
                  virtual: int = DEFAULT_VIRTUAL, speed: float = 1.0,
                  unblocked: bool = False) -> PipelineStep:
    """The step of one copy: one micro-batch is ``share`` of the profiled batch, on ranks of
    compute ``speed`` (:meth:`LayerProfile.seconds`: a layer's fixed part whole, the rest by the
    share), ``byte_scale`` scales the activation bytes; ``transfer(bytes)`` is one message between
    neighbouring stages; ``virtual`` the pieces per rank of interleaved 1F1B. Messages block both
    ends for their transfer (Horovod's collectives, the TensorFlow engine's) unless
    ``unblocked``: sent without waiting and received when they arrive (``torch.distributed``'s
    ``isend``, the PyTorch engine's), so that they overlap the passes."""
    if schedule == "interleaved_1f1b":
        return interleaved_step(layers, stages, virtual, micro, share, byte_scale, transfer, speed)
    pieces = split_layers(layers, stages)
    xfer = max((transfer(p[-1].activation_bytes * byte_scale) for p in pieces[:-1]), default=0.0)
    fwd = max(_seconds(p, share, speed, 0) for p in pieces)
    bwd = max(_seconds(p, share, speed, 1) for p in pieces)
    stage_bytes = [4 * sum(x.params for x in p) for p in pieces]
    if unblocked:
        run = simulate_unblocked([unblocked_actions(schedule, s, stages, micro)
                                  for s in range(stages)], fwd, bwd, xfer)
        return PipelineStep(max(run.finish), run.bubble, fwd, bwd, stage_bytes, xfer,
                            micro * (fwd + bwd))
    lists = [actions(schedule, s, stages, micro) for s in range(stages)]
    timeline = simulate(lists, forward_s=fwd + xfer, backward_s=bwd + xfer)
    return PipelineStep(max(timeline.finish), timeline.bubble, fwd + xfer, bwd + xfer,
                        stage_bytes, xfer, micro * (fwd + bwd + 2 * xfer))


def _seconds(layers: list[LayerProfile], share: float, speed: float, which: int) -> float:
    """Forward (``which`` 0) or backward (1) seconds of ``layers`` for one micro-batch."""
    return sum(x.seconds(share, speed)[which] for x in layers)


def interleaved_step(layers: list[LayerProfile], stages: int, virtual: int, micro: int,
                     share: float, byte_scale: float, transfer: Callable[[float], float],
                     speed: float = 1.0) -> PipelineStep:
    """Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", SC 2021, section 2.2): the layers in ``P v`` pieces, piece ``i``
    on rank ``i % P``. A rank's pass over one micro-batch is its ``v`` pieces', each followed by a
    transfer (``v`` times 1F1B's traffic); the bubble shrinks to ``(P-1)/v`` such passes, so the
    span is ``(m + (P-1)/v)(f + b)`` and the bubble ``(P-1)/(v m + P-1)``."""
    pieces = split_layers(layers, stages * virtual)
    xfer = max((transfer(p[-1].activation_bytes * byte_scale) for p in pieces[:-1]), default=0.0)
    ranks = [[x for piece in pieces[r::stages] for x in piece] for r in range(stages)]
    fwd = max(_seconds(r, share, speed, 0) for r in ranks) + virtual * xfer
    bwd = max(_seconds(r, share, speed, 1) for r in ranks) + virtual * xfer
    busy = micro * (fwd + bwd)
    idle = (stages - 1) * (fwd + bwd) / virtual
    return PipelineStep(busy + idle, idle / (busy + idle), fwd, bwd,
                        [4 * sum(x.params for x in r) for r in ranks], xfer, busy)
