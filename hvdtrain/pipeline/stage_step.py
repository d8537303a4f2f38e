"""The micro-batches of one pipeline stage's train step, framework-free.

:func:`hvdtrain.step.train_step` runs every step; for a pipeline stage its micro-batches go
through a :class:`StageRunner` instead of one forward and backward pass after another: the stage's
action list (:mod:`hvdtrain.pipeline.actions`) run with the framework's :class:`StageKernels`.
The exchange and the update that follow are the step's, over the stage's copies.

Every stage of a pipeline copy is handed the same step (the copy's sample indices), so each knows
every micro-batch's size without loading it: only the first stage needs the inputs and only the last
the targets. A micro-batch that is empty for this copy (an epoch's short last step) is left out
on every stage of the copy alike: the schedule runs over the others, and a short one travels as
it is, so every sample counts once and none is padded. Kernels whose passes hold collectives
among a stage's copies (``StageKernels.runs_empty``) run an empty micro-batch as a pass of no
rows instead, so that every copy runs the same passes.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator
from typing import Any

from hvdtrain.data.sampler import StepIndices
from hvdtrain.exchange import GradientExchange
from hvdtrain.pipeline import actions as act
from hvdtrain.step import StepKernels, add_batch_sums


class StageKernels(StepKernels):
    """What a framework supplies to run one stage's actions; ``i`` is the micro-batch's index in
    the step and ``rows`` its sample count. Passes keep what their backward pass needs (inputs,
    the tape) until it runs; gradients accumulate over the step's micro-batches."""

    stage: int
    stages: int
    runs_empty = False
    """Whether a micro-batch with no samples for this copy runs as a pass of no rows instead of
    being left out: a stage whose passes hold collectives among the stage's copies (TensorFlow's
    ``shard.stage=3`` gathers) needs every copy to run every micro-batch, in the same order."""

    @abc.abstractmethod
    def forward(self, i: int, batch: Any, weight: float) -> tuple[Any, dict[str, Any]] | None:
        """The forward pass of micro-batch ``i`` (``batch``: its loaded ``(x, y)``, None on a
        middle stage). The last stage also takes the summed loss times ``weight`` as the
        objective of the backward pass and returns the summed loss and metrics."""

    @abc.abstractmethod
    def backward_pass(self, i: int) -> None:
        """The backward pass of micro-batch ``i``: its gradients accumulate."""

    @abc.abstractmethod
    def send_activation(self, i: int) -> None:
        """Sends micro-batch ``i``'s output to the next stage (blocks until it is taken)."""

    @abc.abstractmethod
    def recv_activation(self, i: int, rows: int) -> None:
        """Receives micro-batch ``i``'s input from the previous stage."""

    @abc.abstractmethod
    def send_gradient(self, i: int) -> None:
        """Sends the gradient of micro-batch ``i``'s input to the previous stage."""

    @abc.abstractmethod
    def recv_gradient(self, i: int, rows: int) -> None:
        """Receives the gradient of micro-batch ``i``'s output from the next stage."""

    @abc.abstractmethod
    def zero_sums(self) -> dict[str, float]:
        """The sums a step reports before any batch: ``loss``, ``count`` and every metric at 0.
        Every rank reports the same names, whichever stage it holds."""

    def backward(self, batch: Any, weight: float, last: bool) -> tuple[Any, dict[str, Any]]:
        raise NotImplementedError("a pipeline stage runs its actions (StageRunner)")


class StageRunner:
    """Runs one stage's micro-batches by ``schedule``; stands in for
    :func:`hvdtrain.step.run_micro_batches` (the same call and result) and keeps the step's
    seconds spent in messages (``wait_s``: waiting for a neighbour, and the transfer)."""

    def __init__(self, schedule: str) -> None:
        self.schedule = schedule
        self.wait_s = 0.0
        self._lists: dict[tuple[int, int, int], list[act.Action]] = {}

    def actions(self, stage: int, stages: int, micro: int) -> list[act.Action]:
        """The stage's action list for ``micro`` micro-batches (made once per count)."""
        key = (stage, stages, micro)
        if key not in self._lists:
            self._lists[key] = act.actions(self.schedule, stage, stages, micro)
        return self._lists[key]

    def __call__(self, kernels: StepKernels, exchange: GradientExchange, step: StepIndices,
                 weight: float) -> tuple[dict[str, float], float, float | None]:
        assert isinstance(kernels, StageKernels)
        sizes = [len(idx) for idx in step.micro]
        # The micro-batches this copy has samples in (all of them where empty ones run too).
        live = [i for i, n in enumerate(sizes) if n or kernels.runs_empty]
        sums = kernels.zero_sums()
        batches = _Batches(kernels.batches(step))
        self.wait_s = 0.0
        for action in self.actions(kernels.stage, kernels.stages, len(live)):
            i = live[action.micro]
            started = time.perf_counter()
            if action.kind == act.FORWARD:
                batch = batches.get(i)
                scored = kernels.forward(i, batch, weight)
                if scored is not None:
                    add_batch_sums(sums, *scored, sizes[i])
            elif action.kind == act.BACKWARD:
                kernels.backward_pass(i)
            else:
                self._message(kernels, action.kind, i, sizes[i])
                self.wait_s += time.perf_counter() - started
        return sums, batches.waited, None

    @staticmethod
    def _message(kernels: StageKernels, kind: str, i: int, rows: int) -> None:
        if kind == act.SEND_ACTIVATION:
            kernels.send_activation(i)
        elif kind == act.RECV_ACTIVATION:
            kernels.recv_activation(i, rows)
        elif kind == act.SEND_GRADIENT:
            kernels.send_gradient(i)
        else:
            kernels.recv_gradient(i, rows)


class _Batches:
    """The step's loaded micro-batches, taken in order by index (forward passes run in order);
    counts the seconds waited for them."""

    def __init__(self, loaded: Iterator[Any]) -> None:
        self.loaded, self.next, self.waited = loaded, 0, 0.0

    def get(self, i: int) -> Any:
        started = time.perf_counter()
        batch = None
        while self.next <= i:  # empty micro-batches before ``i`` are skipped
            batch = next(self.loaded)
            self.next += 1
        self.waited += time.perf_counter() - started
        return batch
