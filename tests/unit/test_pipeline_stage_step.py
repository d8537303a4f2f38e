"""The stage runner (hvdtrain.pipeline.stage_step) with NumPy stages in threads: the stages of a
copy, each running its schedule's actions, give the unsplit model's loss and gradients, including
a step whose last micro-batches are empty for the copy."""

import queue
import threading

import numpy as np
import pytest

from hvdtrain.data.sampler import StepIndices
from hvdtrain.pipeline.actions import ORDERED
from hvdtrain.pipeline.stage_step import StageKernels, StageRunner

WIDTH = 4


class NumpyStage(StageKernels):
    """A tanh layer (the last stage: a summed squared error against the targets)."""

    def __init__(self, stage: int, stages: int, weight: np.ndarray, data: tuple[list, list],
                 links: dict[tuple[int, str], queue.Queue]) -> None:
        self.stage, self.stages, self.weight, self.data, self.links = stage, stages, weight, data, links
        self.first, self.last = stage == 0, stage == stages - 1
        self.inputs, self.outputs, self.out_grads, self.in_grads = {}, {}, {}, {}
        self.weights: dict[int, float] = {}
        self.grad = np.zeros_like(weight)

    def set_lr(self, lr):
        pass

    def batches(self, step):
        for _ in step.micro:  # only the ends load data, as the engines do
            yield self.data if self.first or self.last else None

    def begin(self):
        self.grad = np.zeros_like(self.weight)

    def gradients(self):
        return [self.grad]

    def zero_sums(self):
        return {"loss": 0.0, "count": 0.0}

    def forward(self, i, batch, weight):
        x = batch[0][i] if self.first else self.inputs[i]
        self.inputs[i] = x
        self.outputs[i] = np.tanh(x @ self.weight)
        if not self.last:
            return None
        self.weights[i] = weight
        return float(((self.outputs[i] - batch[1][i]) ** 2).sum()), {}

    def backward_pass(self, i):
        out, x = self.outputs.pop(i), self.inputs.pop(i)
        # The last stage's loss gradient, weighted; the others' come from the next stage.
        g = (2 * (out - self.data[1][i]) * self.weights.pop(i) if self.last
             else self.out_grads.pop(i))
        pre = g * (1 - out ** 2)
        self.grad += x.T @ pre
        self.in_grads[i] = pre @ self.weight.T

    def send_activation(self, i):
        self.links[self.stage, "act"].put((i, self.outputs[i]))

    def recv_activation(self, i, rows):
        got, x = self.links[self.stage - 1, "act"].get(timeout=30)
        assert got == i and len(x) == rows
        self.inputs[i] = x

    def send_gradient(self, i):
        self.links[self.stage - 1, "grad"].put((i, self.in_grads.pop(i)))

    def recv_gradient(self, i, rows):
        got, g = self.links[self.stage, "grad"].get(timeout=30)
        assert got == i and len(g) == rows
        self.out_grads[i] = g


@pytest.mark.parametrize("schedule", ORDERED)
@pytest.mark.parametrize(("stages", "sizes"), [(2, [3, 3, 3, 3]), (3, [2, 2, 1, 0]), (4, [2, 0, 0, 0]),
                                               (1, [2, 1])])
def test_stages_in_threads_give_the_unsplit_loss_and_gradients(schedule, stages, sizes):
    rng = np.random.default_rng(stages)
    weights = [rng.normal(size=(WIDTH, WIDTH)) for _ in range(stages)]
    xs = [rng.normal(size=(n, WIDTH)) for n in sizes]
    ys = [rng.normal(size=(n, WIDTH)) for n in sizes]
    data = (xs, ys)  # a loaded micro-batch i is (xs, ys), indexed by i
    links = {(s, kind): queue.Queue() for s in range(stages) for kind in ("act", "grad")}
    step = StepIndices([np.arange(n) for n in sizes], global_count=20)
    results: dict[int, tuple] = {}

    def run(s: int) -> None:
        kernels = NumpyStage(s, stages, weights[s], data, links)
        kernels.begin()
        sums, _, fused = StageRunner(schedule)(kernels, None, step, 0.5)
        results[s] = (sums, kernels.gradients()[0], fused)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == list(range(stages))
    # The unsplit network, micro-batch by micro-batch, with the loss weighted by 0.5.
    grads = [np.zeros_like(w) for w in weights]
    loss = 0.0
    for x, y in zip(xs, ys, strict=True):
        acts = [x]
        for w in weights:
            acts.append(np.tanh(acts[-1] @ w))
        loss += float(((acts[-1] - y) ** 2).sum())
        g = 2 * (acts[-1] - y) * 0.5
        for s in reversed(range(stages)):
            pre = g * (1 - acts[s + 1] ** 2)
            grads[s] += acts[s].T @ pre
            g = pre @ weights[s].T
    for s in range(stages):
        sums, grad, fused = results[s]
        np.testing.assert_allclose(grad, grads[s], rtol=1e-12, atol=1e-12)
        assert fused is None
        last = s == stages - 1
        assert sums["count"] == (sum(sizes) if last else 0)
        assert sums["loss"] == (pytest.approx(loss) if last else 0.0)
