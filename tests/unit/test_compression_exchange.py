"""The shared exchange (:mod:`hvdtrain.compression.exchange`) run with NumPy kernels (the reference
functions themselves) by simulated ranks in threads: the plans' rounds, error feedback, byte counts
and the state's gather, restore and re-sharding, with no framework and no Horovod."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from hvdtrain.compression import METHODS, make_plan
from hvdtrain.compression import reference as ref
from hvdtrain.compression.state import by_index, by_name, merge_named
from hvdtrain.config import CommConfig
from tests.unit.numpy_world import F32, Hub, NumpyExchange, noise

SEED = 3
SHAPES = [(24, 16), (16,), (16, 10), (1, 80)]


def on_ranks(size: int, fn: Callable[[int, Hub], Any]) -> list[Any]:
    hub = Hub(size)
    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(lambda r: fn(r, hub), range(size)))


def comm(method: str, **kw: Any) -> CommConfig:
    return CommConfig(compression=method, **{"ratio": 0.1, "min_size": 64, "rank": 2, "bucket": 50,
                                             **kw})


def grads_of(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 * rank + step)
    return [rng.standard_normal(s).astype(F32) for s in SHAPES]


class Reference:
    """Every rank's exchange from the reference functions: the means and each rank's residuals."""

    def __init__(self, c: CommConfig, size: int) -> None:
        self.c, self.size = c, size
        self.plan = make_plan(c, SEED, SHAPES)
        self.residuals: dict[tuple[int, int], np.ndarray] = {}
        self.q = {s.index: s.initial for s in self.plan.slots() if s.kind == "q"}

    def step(self, step: int) -> list[np.ndarray]:
        grads = [grads_of(r, step) for r in range(self.size)]
        return [self.tensor(t, [g[t.index] for g in grads], step) for t in self.plan.tensors]

    def tensor(self, t: Any, grads: list[np.ndarray], step: int) -> np.ndarray:
        c, n = self.c, t.size
        if not t.compressed:
            return ref.dense_mean([g.astype(self.plan.dense_dtype) for g in grads]).reshape(t.shape)
        accs = [ref.error_feedback(g.reshape(-1), self.residuals.get((r, t.index))
                                   if self.plan.uses_feedback else None) for r, g in enumerate(grads)]
        k = ref.num_selected(n, c.ratio)
        if c.compression == "topk":
            pairs = [ref.topk_compress(a, k) for a in accs]
            mean, sent = ref.sparse_mean(pairs, n), [ref.scatter(v, i, n) for v, i in pairs]
        elif c.compression == "randomk":
            idx = ref.randomk_indices(n, k, SEED, step, t.index)
            values = [ref.randomk_compress(a, idx, ref.randomk_scale(n, k, c.error_feedback))
                      for a in accs]
            mean, sent = ref.randomk_mean(values, idx, n), [ref.scatter(v, idx, n) for v in values]
        elif c.compression == "qsgd":
            mean = ref.qsgd_mean([ref.qsgd_compress(a, c.bucket, noise(
                ref.noise_seed(SEED, r, step, t.index), n)) for r, a in enumerate(accs)], c.bucket)
            sent = []
        else:
            matrices = [a.reshape(ref.matrix_shape(t.shape)) for a in accs]
            mean, self.q[t.index], own = ref.powersgd_mean(matrices, self.q[t.index])
            sent = [o.reshape(-1) for o in own]
        for r, (a, s) in enumerate(zip(accs, sent, strict=False)):  # qsgd sends no residual
            self.residuals[(r, t.index)] = ref.new_residual(a, s)
        return mean.reshape(t.shape)


@pytest.mark.parametrize("method, feedback", [(m, True) for m in METHODS] + [
    ("topk", False), ("randomk", False)])
def test_two_ranks_get_the_references_mean_and_keep_its_residuals(method, feedback):
    c = comm(method, error_feedback=feedback)
    reference = Reference(c, 2)
    expected = [reference.step(step) for step in (1, 2, 3)]

    def rank(r: int, hub: Hub) -> tuple[list, dict, dict]:
        exchange = NumpyExchange(make_plan(c, SEED, SHAPES), r, 2, hub)
        outs = [exchange.run(grads_of(r, step)) for step in (1, 2, 3)]
        return outs, dict(exchange.store.arrays), exchange.stats

    for r, (outs, store, stats) in enumerate(on_ranks(2, rank)):
        for step, (got, want) in enumerate(zip(outs, expected, strict=True), start=1):
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6,
                                           err_msg=f"{method} rank {r} step {step} #{i}")
        for key, value in store.items():
            if key.startswith("residual/"):
                np.testing.assert_allclose(value, reference.residuals[(r, int(key[9:]))], atol=1e-6)
            else:
                np.testing.assert_allclose(value, reference.q[int(key[2:])], atol=1e-6)
        assert stats["wire_bytes"] == make_plan(c, SEED, SHAPES).wire_bytes()
        assert stats["dense_bytes"] == 4 * sum(int(np.prod(s)) for s in SHAPES)


def test_dense_methods_send_nothing_at_one_rank():
    exchange = NumpyExchange(make_plan(comm("fp16"), SEED, SHAPES), 0, 1, Hub(1))
    grads = grads_of(0, 1)
    assert exchange.run(grads) == grads
    assert exchange.stats["wire_bytes"] == exchange.stats["dense_bytes"] == 0


@pytest.mark.parametrize("new_size", [2, 3, 1])
def test_state_saved_at_two_ranks_restores_on_rank_0_and_reshards(new_size):
    c = comm("powersgd")

    def save(r: int, hub: Hub) -> tuple[dict, dict]:
        exchange = NumpyExchange(make_plan(c, SEED, SHAPES), r, 2, hub)
        for step in (1, 2):
            exchange.run(grads_of(r, step))
        exchange.gather()
        return exchange.state_dict(), dict(exchange.store.arrays)

    (entry, before0), (_, before1) = on_ranks(2, save)
    assert int(entry["step"]) == 2 and str(entry["method"]) == "powersgd"
    assert entry["residual/0"].shape == (2, 24 * 16)

    def restore(r: int, hub: Hub) -> dict:
        exchange = NumpyExchange(make_plan(c, SEED, SHAPES), r, new_size, hub)
        if r == 0:  # only rank 0 reads the checkpoint
            exchange.load_state_dict(entry, "test")
        exchange.broadcast(root_rank=0)
        assert exchange.step == 2
        return dict(exchange.store.arrays)

    after = on_ranks(new_size, restore)
    for r, arrays in enumerate(after):
        np.testing.assert_array_equal(arrays["q/0"], before0["q/0"])
        want = ((before0, before1)[r]["residual/0"] if new_size == 2
                else (before0["residual/0"] + before1["residual/0"]) / 2)
        np.testing.assert_allclose(arrays["residual/0"], want, rtol=1e-6)


NAMES = ["1.0", "1.1", "3.0", "3.1"]
"""The tensors' names (a pipeline's global names), in the whole model's order."""
STAGES = [[0, 1], [2, 3]]
"""Each stage's tensors, by their places in the whole model."""


def run_and_gather(c: CommConfig, places: list[int], r: int, hub: Hub
                   ) -> tuple[list[list[np.ndarray]], dict]:
    """Two steps and a gather of the exchange of the tensors at ``places`` (seeded by them) on
    rank ``r``: its outputs and its state entry."""
    plan = make_plan(c, SEED, [SHAPES[i] for i in places], places)
    exchange = NumpyExchange(plan, r, 2, hub)
    outs = [exchange.run([grads_of(r, step)[i] for i in places]) for step in (1, 2)]
    exchange.gather()
    return outs, exchange.state_dict()


def test_stages_draw_as_the_whole_model_and_their_state_moves_by_name():
    """Random-k in two stages of two copies each, seeded by each tensor's place, averages what the
    whole model's exchange does; the stages' entries by name merge into the whole model's, and the
    whole model's gives each stage its own slots (how pipeline parts hold exchange state)."""
    c = comm("randomk")
    (want, entry), _ = on_ranks(2, lambda r, hub: run_and_gather(c, [0, 1, 2, 3], r, hub))
    named = []
    for places in STAGES:
        (outs, state), _ = on_ranks(2, lambda r, hub, p=places: run_and_gather(c, p, r, hub))
        for got, full in zip(outs, want, strict=True):
            for g, i in zip(got, places, strict=True):
                np.testing.assert_array_equal(g, full[i])
        named.append(by_name(state, [NAMES[i] for i in places]))
    merged = by_index(merge_named(named, "test"), NAMES)
    assert merged is not None and merged.keys() == entry.keys()
    for key, value in entry.items():
        np.testing.assert_array_equal(merged[key], value, err_msg=key)
    second = by_index(by_name(entry, NAMES), [NAMES[i] for i in STAGES[1]])
    assert second is not None and set(second) == {"method", "step", "residual/0", "residual/1"}
    np.testing.assert_array_equal(second["residual/1"], entry["residual/3"])
