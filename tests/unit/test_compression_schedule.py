"""The step schedule of the compressing exchange (:mod:`hvdtrain.compression.rules`): the dense
start (``comm.dense_steps``) on simulated ranks (:mod:`tests.unit.numpy_world`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hvdtrain.compression import make_plan
from hvdtrain.compression import reference as ref
from hvdtrain.compression.rules import Accordion, dense_start
from hvdtrain.config import CommConfig
from tests.unit.numpy_world import Hub, NumpyExchange
from tests.unit.test_compression_exchange import SEED, SHAPES, comm, grads_of, on_ranks

SIZE, DENSE = 2, 3


def run(c: CommConfig, steps: range, first_step: int = 0) -> list[Any]:
    """Every rank's outputs and bytes over ``steps`` (the gradients of those steps), from an
    exchange whose step counter starts at ``first_step``."""
    def rank(r: int, hub: Hub) -> list[tuple[list[np.ndarray], float, float]]:
        exchange = NumpyExchange(make_plan(c, SEED, SHAPES), r, SIZE, hub)
        exchange.step = first_step
        out = []
        for s in steps:
            got = exchange.run(grads_of(r, s))
            out.append((got, exchange.stats["wire_bytes"], exchange.stats["dense_bytes"]))
        return out
    return on_ranks(SIZE, rank)


@pytest.mark.parametrize("method", ["topk", "randomk", "qsgd", "powersgd"])
def test_the_dense_start_averages_dense_then_the_method_starts_afresh(method):
    """Steps 1 to N are the exact dense mean with dense bytes (``none``'s); step N + 1 is the
    method's first step, with no residual and PowerSGD's initial ``Q`` (torch's
    ``start_powerSGD_iter``): what an exchange without a dense start sends at that step."""
    started = run(comm(method, dense_steps=DENSE), range(1, DENSE + 3))
    fresh = run(comm(method), range(DENSE + 1, DENSE + 3), first_step=DENSE)
    for r in range(SIZE):
        for step in range(1, DENSE + 1):
            got, wire, dense = started[r][step - 1]
            assert wire == dense > 0
            for i, g in enumerate(got):
                want = ref.dense_mean([grads_of(q, step)[i] for q in range(SIZE)])
                np.testing.assert_array_equal(g, want.reshape(g.shape))
        for (got, wire, dense), (want, want_wire, _) in zip(started[r][DENSE:], fresh[r],
                                                              strict=True):
            assert wire == want_wire < dense
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)


def test_the_default_dense_start_is_a_fraction_of_the_runs_steps_rounded_up():
    """``comm.dense_steps: -1`` (the default) takes ``comm.dense_fraction`` of the run's steps,
    rounded up (a fraction that is a whole number of steps stays that number); a count of 0 or
    more is kept whatever the fraction and its floor."""
    default = CommConfig()
    assert (default.dense_steps, default.dense_fraction) == (-1, 0.03)
    assert dense_start(-1, 0.03, 0, 3780) == 114  # 113.4: the MNIST-1D CNN's 60 epochs
    assert dense_start(-1, 0.04, 0, 3780) == 152
    assert dense_start(-1, 0.04, 0, 75) == 3  # 3.0000000000000004 in floating point
    assert dense_start(-1, 0.04, 0, 10) == 1  # any fraction above 0: at least one step
    assert dense_start(-1, 0.0, 0, 1000) == 0
    assert dense_start(-1, 1.0, 0, 20) == 20
    assert dense_start(0, 0.5, 30, 100) == 0 and dense_start(7, 0.5, 30, 100) == 7


def test_the_default_dense_start_has_a_floor_that_long_runs_do_not_reach():
    """The default floor, ``comm.dense_min_steps: 30``, lifts a short run's dense start (200
    steps: 30, above torch's advised 10%), caps at the run's length (a 10-step run is all dense)
    and leaves runs of 1,000 steps or more at the fraction alone."""
    d = CommConfig()
    assert d.dense_min_steps == 30
    start = [dense_start(d.dense_steps, d.dense_fraction, d.dense_min_steps, n)
             for n in (10, 30, 200, 999, 1000, 1001, 2400, 3780)]
    assert start == [10, 30, 30, 30, 30, 31, 72, 114]
    for n in (1000, 1001, 1500, 2400, 3780, 10_000):  # the converged budgets: as before
        assert dense_start(-1, 0.03, 30, n) == dense_start(-1, 0.03, 0, n)
    assert dense_start(-1, 0.0, 30, 200) == 30  # the floor alone


def told(c: CommConfig, total: int, steps: range, state: list[dict] | None = None) -> list[Any]:
    """:func:`run`'s outputs from exchanges told that the run ends at ``total``; with ``state``
    (each rank's :meth:`state_dict`, rank 0's read back) they resume from it first. Also each
    rank's state after the steps."""
    def rank(r: int, hub: Hub) -> tuple[list, dict]:
        exchange = NumpyExchange(make_plan(c, SEED, SHAPES), r, SIZE, hub)
        if state is not None:
            if r == 0:
                exchange.load_state_dict(state[0], "test")
            exchange.broadcast(root_rank=0)
        exchange.run_length(total)
        out = []
        for s in steps:
            got = exchange.run(grads_of(r, s))
            out.append((got, exchange.stats["wire_bytes"], exchange.stats["dense_bytes"]))
        exchange.gather()
        return out, exchange.state_dict()
    return on_ranks(SIZE, rank)


@pytest.mark.parametrize("method", ["topk", "powersgd"])
def test_the_fraction_resolves_when_the_exchange_is_told_the_runs_length(method):
    """Told that the run ends at step 40, the default settings with ``dense_fraction=0.1`` run
    exactly ``dense_steps=4``; never told (code that builds an exchange itself), the exchange
    compresses from the first step."""
    c = comm(method, dense_fraction=0.1, dense_min_steps=0)
    got = told(c, 40, range(1, 8))
    want = run(comm(method, dense_steps=4), range(1, 8))
    untold = run(c, range(1, 8))
    for r in range(SIZE):
        assert [w for _, w, _ in got[r][0]] == [w for _, w, _ in want[r]]
        assert [w == d for _, w, d in got[r][0]] == [True] * 4 + [False] * 3
        assert all(w < d for _, w, d in untold[r])
        for (g, _, _), (w, _, _) in zip(got[r][0], want[r], strict=True):
            for a, b in zip(g, w, strict=True):
                np.testing.assert_array_equal(a, b)


def test_the_floor_lifts_a_short_runs_dense_start():
    """A run of 40 steps at ``dense_fraction=0.1`` (4 steps) with ``dense_min_steps=6`` averages
    dense for 6 steps, then compresses exactly as ``dense_steps=6`` does."""
    got = told(comm("topk", dense_fraction=0.1, dense_min_steps=6), 40, range(1, 9))
    want = run(comm("topk", dense_steps=6), range(1, 9))
    for r in range(SIZE):
        assert [w == d for _, w, d in got[r][0]] == [True] * 6 + [False] * 2
        assert [w for _, w, _ in got[r][0]] == [w for _, w, _ in want[r]]
        for (g, _, _), (w, _, _) in zip(got[r][0], want[r], strict=True):
            for a, b in zip(g, w, strict=True):
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("stop", [2, 4, 5])
def test_a_resume_inside_or_after_the_fractions_dense_start_continues_the_same(stop):
    """A run of 40 steps at ``dense_fraction=0.1`` (4 dense steps) stopped after step ``stop``
    and resumed from its state (the exchange's step travels in it) sends and averages what the
    run without a stop does."""
    c = comm("topk", dense_fraction=0.1, dense_min_steps=0)
    whole = told(c, 40, range(1, 9))
    first = told(c, 40, range(1, stop + 1))
    resumed = told(c, 40, range(stop + 1, 9), state=[s for _, s in first])
    for r in range(SIZE):
        assert [w for _, w, _ in resumed[r][0]] == [w for _, w, _ in whole[r][0][stop:]]
        for (g, _, _), (w, _, _) in zip(resumed[r][0], whole[r][0][stop:], strict=True):
            for a, b in zip(g, w, strict=True):
                np.testing.assert_array_equal(a, b)


def test_accordion_compresses_less_where_the_norm_moves():
    """The first interval compresses less; then an interval whose mean norm moved by the threshold
    or more of the previous one's compresses less, a steady one as configured."""
    acc = Accordion(interval=2, threshold=0.5)
    levels = []
    for step, norm in enumerate([4, 4, 4, 4, 1, 1, 1.2, 1.2, 2, 2], start=1):
        levels.append(acc.low)
        acc.add(norm)
        if acc.due(step):
            acc.decide(acc.local_mean())
    assert levels == [True, True, True, True, False, False, True, True, False, False]
    fresh = Accordion(2, 0.5)
    fresh.load(acc.state())
    assert (fresh.low, fresh.previous, fresh.count) == (acc.low, acc.previous, acc.count)


SCALES = {**dict.fromkeys(range(1, 7), 1.0), **dict.fromkeys(range(7, 13), 8.0)}
"""Gradient scale per step: steady for two intervals of 3, then a jump (the norm moves)."""


def adaptive_run(method: str, steps: int = 12) -> list[list[tuple[bool, float]]]:
    """Every rank's (level before the step, wire bytes) over ``steps`` steps of 3-step intervals."""
    c = comm(method, adaptive=True, adaptive_interval=3, adaptive_factor=4, ratio=0.05)

    def rank(r: int, hub: Hub) -> list[tuple[bool, float]]:
        exchange = NumpyExchange(make_plan(c, SEED, SHAPES), r, SIZE, hub)
        out = []
        for s in range(1, steps + 1):
            low = exchange.rule.accordion.low
            exchange.run([g * np.float32(SCALES[s]) for g in grads_of(r, s)])
            out.append((low, exchange.stats["wire_bytes"]))
        return out
    return on_ranks(SIZE, rank)


@pytest.mark.parametrize("method", ["topk", "randomk", "powersgd"])
def test_the_adaptive_switch_is_the_same_on_every_rank_and_shows_in_the_bytes(method):
    ranks = adaptive_run(method)
    assert ranks[0] == ranks[1]  # the same level and bytes on both ranks, every step
    levels = [low for low, _ in ranks[0]]
    # Steps 1-3: the first interval (low); 4-6 after a steady one would be the configured level,
    # but 4-6 follow the first decision, taken with no previous norm: low; 7-9 follow a steady
    # interval: configured; 10-12 follow the jump at step 7: low.
    assert levels == [True] * 6 + [False] * 3 + [True] * 3
    wire = {low: {b for lo, b in ranks[0] if lo == low} for low in (True, False)}
    assert len(wire[True]) == len(wire[False]) == 1
    assert wire[True].pop() > wire[False].pop()  # the low compression level sends more


def test_the_adaptive_switch_travels_in_the_checkpoint():
    """A restored exchange continues the switch where the saved one stood (level, previous norm,
    the interval's running sum), so a resumed run takes the saved run's decisions."""
    c = comm("powersgd", adaptive=True, adaptive_interval=3)

    def rank(r: int, hub: Hub) -> tuple[dict, Any]:
        exchange = NumpyExchange(make_plan(c, SEED, SHAPES), r, SIZE, hub)
        for s in range(1, 8):
            exchange.run([g * np.float32(SCALES[s]) for g in grads_of(r, s)])
        exchange.gather()
        return exchange.state_dict(), exchange.rule.accordion.state()

    (entry, saved), _ = on_ranks(SIZE, rank)
    assert "qlow/0" in entry and "q/0" in entry  # a warm start per level

    def restore(r: int, hub: Hub) -> Any:
        exchange = NumpyExchange(make_plan(c, SEED, SHAPES), r, SIZE, hub)
        exchange.load_state_dict(entry if r == 0 else None, "test")
        exchange.broadcast(0)
        return exchange.rule.accordion.state()

    for state in on_ranks(SIZE, restore):
        np.testing.assert_array_equal(state, saved)
