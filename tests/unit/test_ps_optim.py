"""The servers' NumPy update (``ps.consistency=ssp``/``asp``) against values worked out by hand
from PyTorch's documented formulas, and the staleness bookkeeping; no MPI, no framework."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hvdtrain.ps.optim import Clocks, ShardOptimizer


def shard(values: list[float]) -> np.ndarray:
    return np.array(values, np.float32)


def test_sgd_with_momentum_and_decay_follows_torch_sgd():
    p = shard([1.0, 2.0])
    opt = ShardOptimizer("sgd", p, lr=0.1, momentum=0.9)
    opt.step(shard([0.5, -1.0]))  # first step: the buffer is the gradient
    np.testing.assert_allclose(p, [0.95, 2.1], rtol=1e-6)
    opt.step(shard([0.5, -1.0]))  # buffer 0.9 * g + g = [0.95, -1.9]
    np.testing.assert_allclose(p, [0.855, 2.29], rtol=1e-6)
    assert opt.state_bytes() == 2 * 4

    p = shard([1.0])
    ShardOptimizer("sgd", p, lr=0.1, momentum=0.0, weight_decay=0.5).step(shard([2.0]))
    assert p[0] == pytest.approx(1.0 - 0.1 * (2.0 + 0.5 * 1.0))  # L2 added to the gradient


def adam_by_hand(p: float, grads: list[float], lr: float, wd: float = 0.0,
                 decoupled: bool = False) -> float:
    """One element through torch.optim.Adam / AdamW's documented algorithm, in plain floats."""
    b1, b2, eps, m, v = 0.9, 0.999, 1e-8, 0.0, 0.0
    for t, g in enumerate(grads, start=1):
        if decoupled:
            p *= 1 - lr * wd
        else:
            g += wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p -= lr / (1 - b1 ** t) * m / (math.sqrt(v) / math.sqrt(1 - b2 ** t) + eps)
    return p


@pytest.mark.parametrize(("name", "wd"), [("adam", 0.0), ("adam", 0.1), ("adamw", 0.1)])
def test_adam_follows_the_documented_algorithm(name, wd):
    p = shard([1.0, -2.0])
    opt = ShardOptimizer(name, p, lr=0.01, weight_decay=wd)
    grads = [[1.0, 0.5], [3.0, -0.5], [-2.0, 0.25]]
    for g in grads:
        opt.step(shard(g))
    for i, start in enumerate([1.0, -2.0]):
        want = adam_by_hand(start, [g[i] for g in grads], 0.01, wd, decoupled=name == "adamw")
        assert p[i] == pytest.approx(want, rel=1e-6), i
    assert opt.steps == 3 and opt.state_bytes() == 2 * 2 * 4


def test_adam_first_step_moves_every_element_by_lr():
    """Bias correction: Adam's first step is lr * sign(g) whatever the gradient's size."""
    p = shard([0.0, 0.0, 0.0])
    ShardOptimizer("adam", p, lr=0.1).step(shard([1e-2, -50.0, 7.0]))
    np.testing.assert_allclose(p, [-0.1, 0.1, -0.1], rtol=1e-5)


def test_a_shard_must_be_contiguous_float32_and_the_optimizer_known():
    with pytest.raises(ValueError, match="contiguous float32"):
        ShardOptimizer("sgd", np.zeros(3), lr=0.1)
    with pytest.raises(ValueError, match=r"optim\.name='lamb'"):
        ShardOptimizer("lamb", shard([0.0]), lr=0.1)


def test_ssp_holds_a_worker_that_runs_more_than_the_bound_ahead():
    clocks = Clocks(workers=2, staleness=1)
    assert clocks.applied(0, 0) == 0  # worker 0 pushes on version 0, first: fresh
    assert clocks.may_pull(0)  # one ahead of worker 1: within the bound
    assert clocks.applied(0, 1) == 0
    assert not clocks.may_pull(0)  # two ahead: waits for worker 1
    assert clocks.may_pull(1)
    assert clocks.applied(1, 0) == 2  # worker 1's push was computed before both of worker 0's
    assert clocks.may_pull(0)
    assert clocks.drain() == {"staleness_mean": 2 / 3, "staleness_max": 2.0}
    assert clocks.drain() == {"staleness_mean": 0.0, "staleness_max": 0.0}


def test_asp_never_holds_a_worker_and_staleness_is_counted():
    clocks = Clocks(workers=2, staleness=None)
    for version in range(5):
        assert clocks.may_pull(0)
        clocks.applied(0, version)
    assert clocks.clocks == [5, 0] and clocks.may_pull(0)
    assert clocks.applied(1, 0) == 5
    with pytest.raises(ValueError, match="pushed on version 9"):
        clocks.applied(1, 9)
