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
from hvdtrain.errors import HvdtrainError
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


NAMES = ["0.weight", "0.bias", "2.weight", "4.weight"]
STAGES = [[0, 2], [1, 3]]  # tensor positions of two "stages" (a split need not be contiguous)


@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("none", "fp16")])
def test_stages_exchange_what_the_whole_model_does_and_their_state_moves_by_name(method):
    """Two stages' exchanges (each in its own group of the same two ranks, their tensors'
    places given) average exactly what one exchange over the whole model averages, and their
    states, by parameter name, merge into the whole model's and split back."""
    c = comm(method)

    def rank(r: int, hubs: tuple[Hub, Hub, Hub]) -> tuple[list, dict, list[dict]]:
        whole = NumpyExchange(make_plan(c, SEED, SHAPES), r, 2, hubs[0])
        stages = [NumpyExchange(make_plan(c, SEED, [SHAPES[i] for i in own], own), r, 2, hub)
                  for own, hub in zip(STAGES, hubs[1:], strict=True)]
        outs = []
        for step in (1, 2, 3):
            grads = grads_of(r, step)
            got = [None] * len(SHAPES)
            for own, stage in zip(STAGES, stages, strict=True):
                for i, g in zip(own, stage.run([grads[i] for i in own]), strict=True):
                    got[i] = g
            outs.append((whole.run(grads), got))
        for exchange in (whole, *stages):
            exchange.gather()
        return outs, whole.state_dict(), [s.state_dict() for s in stages]

    hubs = (Hub(2), Hub(2), Hub(2))
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda r: rank(r, hubs), range(2)))
    for outs, whole_state, stage_states in results:
        for want, got in outs:
            for w, g in zip(want, got, strict=True):
                np.testing.assert_array_equal(g, w)
        named = [by_name(s, [NAMES[i] for i in own])
                 for s, own in zip(stage_states, STAGES, strict=True)]
        merged = merge_named(named, "test")
        assert merged.keys() == by_name(whole_state, NAMES).keys()
        back = by_index(merged, NAMES)
        assert back is not None and back.keys() == whole_state.keys()
        for key, value in whole_state.items():
            np.testing.assert_array_equal(back[key], value, err_msg=key)
        first = by_index(merged, [NAMES[i] for i in STAGES[0]])
        assert first is not None and first.keys() == stage_states[0].keys()


def test_parts_that_disagree_on_the_step_are_refused():
    with pytest.raises(HvdtrainError, match="disagree on the compression step"):
        merge_named([{"step": np.array(3)}, {"step": np.array(4)}], "step-4.ckpt")
    assert by_index({}, NAMES) is None and by_name(None, NAMES) == {}
