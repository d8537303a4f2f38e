"""The exchange's update rules (:mod:`hvdtrain.compression.rules`) against DGC and compressed Adam
written out by hand in NumPy, on simulated ranks (:mod:`tests.unit.numpy_world`), and their state
through a checkpoint and an elastic resize."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from hvdtrain.compression import make_plan
from hvdtrain.compression import reference as ref
from hvdtrain.compression.rules import DGC, CompressedAdam, OptimizerSettings, Rule, make_rule
from hvdtrain.config import CommConfig, ConfigError, load_config
from tests.unit.numpy_world import F32, Hub, NumpyExchange
from tests.unit.test_compression_exchange import SEED, SHAPES, grads_of, on_ranks

SGD = OptimizerSettings("sgd", momentum=0.9, weight_decay=0.01)
WEIGHTS = [np.full(s, 0.5, F32) for s in SHAPES]


def comm(method: str, **kw: Any) -> CommConfig:
    return CommConfig(compression=method, **{"ratio": 0.1, "min_size": 64, "momentum_correction": True,
                                          "compress_momentum": True, **kw})


def run_ranks(c: CommConfig, opt: OptimizerSettings, size: int, steps: int) -> list[Any]:
    def rank(r: int, hub: Hub) -> tuple[list, NumpyExchange]:
        exchange = NumpyExchange(make_plan(c, SEED, SHAPES), r, size, hub, opt, lambda: WEIGHTS)
        return [exchange.run(grads_of(r, s)) for s in range(1, steps + 1)], exchange
    return on_ranks(size, rank)


def dgc_by_hand(c: CommConfig, size: int, steps: int) -> list[list[np.ndarray]]:
    """DGC as the paper's Algorithm 1 (with momentum factor masking), top-k, per tensor, after
    ``c.dense_steps`` of plain momentum SGD on the dense mean, whose velocity every rank's DGC
    velocity then starts from; the density warm-up counts from the end of the dense start."""
    plan = make_plan(c, SEED, SHAPES)
    dense = max(c.dense_steps, 0)  # -1: a fraction of the run, 0 where no trainer tells its length
    u = {(r, i): np.zeros(int(np.prod(s)), F32) for r in range(size) for i, s in enumerate(SHAPES)}
    v = {key: value.copy() for key, value in u.items()}
    dense_u = {i: np.zeros(int(np.prod(s)), F32) for i, s in enumerate(SHAPES)}
    out = []
    for step in range(1, steps + 1):
        grads = [[(g + F32(SGD.weight_decay) * w).reshape(-1)
                  for g, w in zip(grads_of(r, step), WEIGHTS, strict=True)] for r in range(size)]
        if c.clip_norm:
            grads = [[g * ref.clip_factor(gs, c.clip_norm / np.sqrt(size)) for g in gs]
                     for gs in grads]
        ratio = ref.warmup_ratio(c.ratio, step - dense, c.sparsity_warmup_steps)
        row = []
        for t in plan.tensors:
            i, n = t.index, t.size
            if t.compressed and step <= dense:
                dense_u[i] = dense_u[i] * F32(0.9) + ref.dense_mean([g[i] for g in grads])
                for r in range(size):
                    u[r, i] = dense_u[i].copy()
                row.append(dense_u[i].reshape(t.shape))
                continue
            if not t.compressed:
                dense_u[i] = dense_u[i] * F32(0.9) + ref.dense_mean([g[i] for g in grads])
                row.append(dense_u[i].reshape(t.shape))
                continue
            pairs = []
            for r in range(size):
                u[r, i] = u[r, i] * F32(0.9) + grads[r][i]
                v[r, i] = v[r, i] + u[r, i]
                values, idx = ref.topk_compress(v[r, i], ref.num_selected(n, ratio))
                v[r, i] = v[r, i] - ref.scatter(values, idx, n)
                if c.momentum_masking:
                    u[r, i] = ref.zero_at(u[r, i], idx)
                pairs.append((values, idx))
            row.append(ref.sparse_mean(pairs, n).reshape(t.shape))
        out.append(row)
    return out


@pytest.mark.parametrize("extra", [{"sparsity_warmup_steps": 0}, {"momentum_masking": True},
                                   {"clip_norm": 1.0, "sparsity_warmup_steps": 4,
                                    "momentum_masking": True},
                                   {"dense_steps": 2, "sparsity_warmup_steps": 2}],
                         ids=["no-warmup", "masking", "clip-warmup-masking", "dense-start"])
def test_dgc_is_the_papers_algorithm(extra):
    c = comm("topk", **extra)
    expected = dgc_by_hand(c, 2, 5)
    for r, (outs, exchange) in enumerate(run_ranks(c, SGD, 2, 5)):
        assert exchange.rule.updates and exchange.unscaled_first
        for step, (got, want) in enumerate(zip(outs, expected, strict=True), start=1):
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6,
                                           err_msg=f"rank {r} step {step} #{i}")


def test_the_density_warm_up_goes_as_dgcs():
    ratios = [ref.warmup_ratio(0.001, s, 5) for s in range(1, 7)]
    assert ratios == pytest.approx([0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001])
    assert [ref.warmup_ratio(0.01, s, 8) for s in (1, 3, 5, 7, 9)] == pytest.approx(
        [0.25, 0.0625, 0.015625, 0.01, 0.01])
    assert ref.warmup_ratio(0.01, 1, 0) == 0.01


def adam_by_hand(c: CommConfig, opt: OptimizerSettings, size: int, steps: int) -> list[list]:
    """Dense Adam for the warm-up, then frozen variance and the mean of the ranks' top-k of
    (local momentum + residual) as the shared momentum (1-bit Adam's Algorithm 1)."""
    plan = make_plan(c, SEED, SHAPES)
    b1, b2, warm = opt.beta1, opt.beta2, c.dense_steps
    m = {i: np.zeros(int(np.prod(s)), F32) for i, s in enumerate(SHAPES)}
    v = {i: x.copy() for i, x in m.items()}
    e = {(r, i): x.copy() for r in range(size) for i, x in m.items()}
    out = []
    for step in range(1, steps + 1):
        grads = [[g.reshape(-1) for g in grads_of(r, step)] for r in range(size)]
        row = []
        for t in plan.tensors:
            i, n = t.index, t.size
            if step <= warm or not t.compressed:
                g = ref.dense_mean([gs[i] for gs in grads])
                m[i] = m[i] * F32(b1) + g * F32(1 - b1)
                v[i] = v[i] * F32(b2) + g * g * F32(1 - b2)
                t_v = step
            else:
                pairs = []
                for r in range(size):
                    acc = m[i] * F32(b1) + grads[r][i] * F32(1 - b1) + e[r, i]
                    values, idx = ref.topk_compress(acc, ref.num_selected(n, c.ratio))
                    e[r, i] = acc - ref.scatter(values, idx, n)
                    pairs.append((values, idx))
                new_m = ref.sparse_mean(pairs, n)
                g = (new_m - m[i] * F32(b1)) / F32(1 - b1)  # entries with no variance take one
                v[i] = np.where(v[i] == 0, g * g * F32(1 - b2), v[i])
                m[i], t_v = new_m, warm
            row.append(ref.adam_direction(m[i], v[i], step, t_v, b1, b2, opt.eps).reshape(t.shape))
        out.append(row)
    return out


def test_compressed_adam_is_1bit_adams_algorithm_with_top_k():
    c, opt = comm("topk", dense_steps=2), OptimizerSettings("adam")
    expected = adam_by_hand(c, opt, 2, 5)
    for r, (outs, _) in enumerate(run_ranks(c, opt, 2, 5)):
        for step, (got, want) in enumerate(zip(outs, expected, strict=True), start=1):
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5,
                                           err_msg=f"rank {r} step {step} #{i}")


def test_an_entry_with_no_variance_to_freeze_gets_adams_first_step_not_m_over_eps():
    """An entry whose gradient is 0 through the warm-up (issue 36: digits pixels no warm-up batch
    lit, NaN under fp16) freezes at its first nonzero exchanged gradient with Adam's first
    variance, so its direction stays within Kingma and Ba's bound; the others keep theirs."""
    warm, size, n = 3, 2, 100
    c, opt = comm("qsgd", dense_steps=warm), OptimizerSettings("adam")
    silent = np.arange(5)

    def rank(r: int, hub: Hub) -> tuple[list, list]:
        exchange = NumpyExchange(make_plan(c, SEED, [(n,)]), r, size, hub, opt)
        directions, variances = [], []
        for step in range(1, 9):
            g = np.random.default_rng(10 * step + r).standard_normal(n).astype(F32)
            if step <= warm:
                g[silent] = 0
            directions.append(exchange.run([g])[0])
            variances.append(exchange.store.numpy("variance/0"))
        return directions, variances

    (directions, variances), _ = on_ranks(size, rank)
    b1, b2 = opt.beta1, opt.beta2
    assert not variances[warm - 1][silent].any()
    first = directions[warm][silent]  # the first compressed step: m = (1 - b1) g, v = (1 - b2) g^2
    m_scale, v_scale = 1 / (1 - b1 ** (warm + 1)), 1 / (1 - b2 ** warm)
    np.testing.assert_allclose(np.abs(first[first != 0]),
                               m_scale * (1 - b1) / np.sqrt((1 - b2) * v_scale), rtol=1e-3)
    assert (first != 0).sum() >= 3
    for step, (d, v) in enumerate(zip(directions, variances, strict=True), start=1):
        assert np.all(np.abs(d[silent]) <= (1 - b1) / np.sqrt(1 - b2)), step
        if step > warm:  # frozen: the warm-up's variance, or the one taken at the first step
            np.testing.assert_array_equal(v, variances[warm])
            assert variances[warm][silent][first != 0].all()


def test_adamw_decay_is_added_to_the_direction_and_adams_l2_to_the_gradient():
    c = comm("qsgd", dense_steps=5)
    # Step 2's directions (step 1's is about sign(g) whatever is added to g).
    decoupled = run_ranks(c, OptimizerSettings("adamw", weight_decay=0.1), 1, 2)[0][0][1]
    undecayed = run_ranks(c, OptimizerSettings("adam"), 1, 2)[0][0][1]
    l2 = run_ranks(c, OptimizerSettings("adam", weight_decay=0.1), 1, 2)[0][0][1]
    for a, b, c_, w in zip(decoupled, undecayed, l2, WEIGHTS, strict=True):
        np.testing.assert_allclose(a, b + F32(0.1) * w, rtol=1e-6)
        assert not np.allclose(b, c_)


@pytest.mark.parametrize("new_size", [2, 3])
@pytest.mark.parametrize("opt, per_rank, shared", [
    (SGD, "velocity/0", "momentum/1"), (OptimizerSettings("adam"), "residual/0", "variance/0")],
    ids=["dgc", "adam"])
def test_velocities_and_frozen_variance_checkpoint_and_reshard(new_size, opt, per_rank, shared):
    c = comm("topk", dense_steps=1)
    before = [dict(exchange.store.arrays) for _, exchange in run_ranks(c, opt, 2, 3)]

    def save(r: int, hub: Hub) -> dict:
        exchange = NumpyExchange(make_plan(c, SEED, SHAPES), r, 2, hub, opt, lambda: WEIGHTS)
        exchange.store.arrays = dict(before[r])
        exchange.step = 3
        exchange.gather()
        return exchange.state_dict()

    entry = on_ranks(2, save)[0]
    assert entry[per_rank].shape[0] == 2 and entry[shared].ndim == 1
    assert not np.array_equal(before[0][per_rank], before[1][per_rank])

    def restore(r: int, hub: Hub) -> dict:
        exchange = NumpyExchange(make_plan(c, SEED, SHAPES), r, new_size, hub, opt)
        if r == 0:
            exchange.load_state_dict(entry, "test")
        exchange.broadcast(root_rank=0)
        assert exchange.step == 3
        return dict(exchange.store.arrays)

    for r, arrays in enumerate(on_ranks(new_size, restore)):
        np.testing.assert_array_equal(arrays[shared], before[0][shared])
        want = (before[r][per_rank] if new_size == 2
                else (before[0][per_rank] + before[1][per_rank]) / 2)
        np.testing.assert_allclose(arrays[per_rank], want, rtol=1e-6)


@pytest.mark.parametrize("off", [["comm.dense_steps=0"],
                                 ["comm.dense_fraction=0", "comm.dense_min_steps=0"]])
def test_adam_warm_up_must_leave_a_variance_to_freeze(off):
    with pytest.raises(ConfigError, match=r"comm.compress_momentum=true needs a dense start "
                                          r"\(comm.dense_steps >= 1, or -1 with "
                                          r"comm.dense_fraction > 0 or comm.dense_min_steps >= 1\)"):
        load_config(None, ["comm.compression=topk", "optim.name=adam", "comm.compress_momentum=true",
                           *off], environ={})
    # The floor alone is a dense start.
    cfg = load_config(None, ["comm.compression=topk", "optim.name=adam",
                             "comm.compress_momentum=true", "comm.dense_fraction=0"], environ={})
    assert cfg.comm.dense_min_steps == 30


@pytest.mark.parametrize(("key", "value"), [("dense_fraction", "0.1"), ("dense_min_steps", "5")])
def test_a_dense_fraction_or_floor_beside_a_count_of_dense_steps_is_refused(key, value):
    assert refusal(["comm.compression=topk", "comm.dense_steps=10", f"comm.{key}={value}"]) == (
        f"comm.{key}={value} does nothing with comm.dense_steps=10: a count of dense steps "
        "wins over the fraction and its floor; set comm.dense_steps=-1 to use them")
    cfg = load_config(None, ["comm.compression=topk", "comm.dense_steps=-1",
                             f"comm.{key}={value}"], environ={})
    assert (cfg.comm.dense_steps, str(getattr(cfg.comm, key))) == (-1, value)


@pytest.mark.parametrize(("key", "value", "default"), [("dense_steps", "5", "-1"),
                                                       ("dense_fraction", "0.1", "0.03"),
                                                       ("dense_min_steps", "5", "30")])
def test_the_dense_start_is_refused_with_parameter_servers(key, value, default):
    assert refusal(["comm.topology=ps", "comm.compression=topk", f"comm.{key}={value}"]) == (
        f"comm.{key}={value} does nothing with comm.topology='ps': the parameter servers' codec "
        f"compresses from the first step; leave it at its default {default}")


def test_the_old_adam_warm_up_key_names_the_dense_start():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["comm.adam_warmup_steps=20"], environ={})
    assert str(err.value) == ("comm.adam_warmup_steps is gone: compressed Adam's dense warm-up is the "
                              "dense start of every method, comm.dense_steps (at least 1 with "
                              "comm.compress_momentum=true)")


# Refusals: a rule or key that would do nothing is a one-line error at validation ------------------

TOPOLOGY = ("the update rules run in the ring's compressing exchange, and parameter servers only sum "
            "gradients")
REFUSED = [
    (["comm.momentum_correction=true"], "comm.momentum_correction=true does nothing with "
     "comm.compression='none': DGC corrects the momentum of sparsified gradients, topk and randomk only"),
    *[(["comm.momentum_correction=true", f"comm.compression={m}"],
       f"comm.momentum_correction=true does nothing with comm.compression={m!r}: DGC corrects the "
       "momentum of sparsified gradients, topk and randomk only") for m in ("fp16", "qsgd", "powersgd")],
    *[(["comm.momentum_correction=true", "comm.compression=topk", f"optim.name={o}"],
       f"comm.momentum_correction=true does nothing with optim.name={o!r}: DGC corrects SGD momentum "
       "(comm.compress_momentum is Adam's)") for o in ("adam", "adamw")],
    (["comm.momentum_correction=true", "comm.compression=randomk", "optim.momentum=0"],
     "comm.momentum_correction=true does nothing with optim.momentum=0: DGC corrects SGD momentum, "
     "and there is none"),
    (["comm.momentum_correction=true", "comm.compression=topk", "comm.error_feedback=false"],
     "comm.momentum_correction=true does nothing with comm.error_feedback=false: DGC accumulates the "
     "velocity in the error-feedback residual"),
    (["comm.compress_momentum=true", "comm.compression=topk"], "comm.compress_momentum=true does "
     "nothing with optim.name='sgd': it compresses Adam's and AdamW's momentum "
     "(comm.momentum_correction is SGD's)"),
    *[(["comm.compress_momentum=true", "optim.name=adam", f"comm.compression={m}"],
       f"comm.compress_momentum=true does nothing with comm.compression={m!r}: compressed momentum is "
       "sent by topk, randomk and qsgd only") for m in ("none", "fp16", "powersgd")],
    (["comm.compress_momentum=true", "optim.name=adamw", "comm.compression=randomk",
      "comm.error_feedback=false"], "comm.compress_momentum=true does nothing with "
     "comm.error_feedback=false: compressed Adam always keeps error feedback (1-bit Adam's error "
     "compensation)"),
    # Both rules on: the optimizer's own one runs, the other is refused.
    (["comm.compression=topk", "comm.momentum_correction=true", "comm.compress_momentum=true"],
     "comm.compress_momentum=true does nothing with optim.name='sgd'"),
]
"""Overrides of the defaults (SGD, momentum 0.9, ring) and the whole message."""

SUB_KEYS = [("momentum_masking", "true", "momentum_correction", "false"),
            ("clip_norm", "1.0", "momentum_correction", "0.0"),
            ("sparsity_warmup_steps", "0", "momentum_correction", "250")]
"""Each key read by one update rule only: a value it may take, its rule, its default."""
METHOD_KEYS = [("ratio", "0.1", "0.01", ("topk", "randomk"), "topk and randomk"),
               ("rank", "4", "2", ("powersgd",), "powersgd"),
               ("bucket", "64", "512", ("qsgd",), "qsgd"),
               ("min_size", "0", "1024", ("topk", "randomk", "qsgd", "powersgd"),
                "topk, randomk, qsgd and powersgd"),
               ("error_feedback", "false", "true", ("topk", "randomk", "powersgd"),
                "topk, randomk and powersgd"),
               ("dense_steps", "5", "-1", ("topk", "randomk", "qsgd", "powersgd"),
                "topk, randomk, qsgd and powersgd"),
               ("dense_fraction", "0.1", "0.03", ("topk", "randomk", "qsgd", "powersgd"),
                "topk, randomk, qsgd and powersgd")]
"""Each method parameter: a value, its default, the methods that read it, as the message lists them."""
METHODS = ("none", "fp16", "topk", "randomk", "qsgd", "powersgd")
STAGES = ["pipeline.stages=2", "pipeline.microbatches=2"]
RING_AND_STAGES = pytest.mark.parametrize("where", [[], STAGES], ids=["ring", "stages"])


def refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides, environ={})
    return str(info.value)


@RING_AND_STAGES
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.parametrize(("overrides", "message"), REFUSED)
def test_an_update_rule_that_would_do_nothing_is_refused(overrides, message, framework, where):
    got = refusal([f"framework={framework}", *where, *overrides])
    assert got.startswith(message) and "\n" not in got, got


@pytest.mark.parametrize("overrides", [
    ["comm.compression=topk", "comm.momentum_correction=true"],  # runs on the ring
    ["comm.compression=fp16", "comm.momentum_correction=true", "ps.consistency=asp"],
    ["comm.compression=qsgd", "comm.compress_momentum=true", "optim.name=adam"],
    ["comm.compression=none", "comm.momentum_correction=true"],  # the topology is named first
    ["comm.compression=fp16", "comm.compress_momentum=true", "optim.name=sgd"],
])
def test_the_update_rules_are_refused_with_parameter_servers(overrides):
    rule = next(o.split("=")[0] for o in overrides if o.startswith("comm.") and "momentum" in o)
    assert refusal(["comm.topology=ps", *overrides]) == (
        f"{rule}=true does nothing with comm.topology='ps': {TOPOLOGY}")


@RING_AND_STAGES
@pytest.mark.parametrize(("key", "value", "rule", "default"), SUB_KEYS)
def test_a_rules_key_without_its_rule_is_refused(key, value, rule, default, where):
    for method in METHODS:
        assert refusal([*where, f"comm.compression={method}", f"comm.{key}={value}"]) == (
            f"comm.{key}={value} does nothing with comm.{rule}=false: only that rule reads it; set "
            f"comm.{rule}=true or leave comm.{key} at its default {default}")


@RING_AND_STAGES
@pytest.mark.parametrize(("key", "value", "default", "readers", "listed"), METHOD_KEYS)
def test_a_method_parameter_is_refused_with_a_method_that_does_not_read_it(
        key, value, default, readers, listed, where):
    for method in METHODS:
        overrides = [*where, f"comm.compression={method}", f"comm.{key}={value}"]
        if method in readers:
            assert str(getattr(load_config(None, overrides, environ={}).comm, key)).lower() == value
        else:
            assert refusal(overrides) == (
                f"comm.{key}={value} does nothing with comm.compression={method!r}: only {listed} "
                f"read it; leave it at its default {default}")


VALID = [
    (["comm.compression=topk", "comm.momentum_correction=true"], "DGC"),
    (["comm.compression=randomk", "comm.momentum_correction=true", "optim.momentum=0.5",
      "comm.momentum_masking=true", "comm.clip_norm=2", "comm.sparsity_warmup_steps=0"], "DGC"),
    *[([f"comm.compression={m}", "comm.compress_momentum=true", f"optim.name={o}",
        "comm.dense_steps=5"], "CompressedAdam")
      for m in ("topk", "randomk", "qsgd") for o in ("adam", "adamw")],
    # The sub-keys at their defaults (as a config file may spell them) with the rules off.
    (["comm.compression=qsgd", "comm.sparsity_warmup_steps=250",
      "comm.clip_norm=0", "comm.ratio=0.01", "comm.error_feedback=true"], "Rule"),
]


@RING_AND_STAGES
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.parametrize(("overrides", "rule"), VALID)
def test_the_combinations_the_rules_run_in_are_accepted(overrides, rule, framework, where):
    cfg = load_config(None, [f"framework={framework}", *where, *overrides], environ={})
    plan = make_plan(cfg.comm, SEED, SHAPES)
    opt = OptimizerSettings(cfg.optim.name, momentum=cfg.optim.momentum)
    assert type(make_rule(plan, cfg.comm, opt)).__name__ == rule


@pytest.mark.parametrize("method", METHODS)
def test_the_config_refuses_a_rule_exactly_where_the_exchange_would_not_run_it(method):
    """One rule: with a rule turned on, the config loads where :func:`make_rule` picks it and
    refuses where it would fall back to plain averaging, over every method, optimizer, SGD
    momentum and error feedback."""
    for flag, name, momentum, feedback in itertools.product(
            ("momentum_correction", "compress_momentum"), ("sgd", "adam", "adamw"), (0.0, 0.9),
            (True, False)):
        if name != "sgd" and momentum != 0.9:
            continue  # optim.momentum is refused with Adam (test_config_errors.py)
        feedback_key = [] if feedback or method not in ("topk", "randomk", "powersgd") else [
            "comm.error_feedback=false"]
        # Compressed Adam's warm-up is the dense start (the misfits are named before it).
        dense = ["comm.dense_steps=5"] if flag == "compress_momentum" and method not in (
            "none", "fp16") else []
        overrides = [f"comm.compression={method}", f"comm.{flag}=true", f"optim.name={name}",
                     f"optim.momentum={momentum}", *feedback_key, *dense]
        c = CommConfig(compression=method, error_feedback=feedback or not feedback_key,
                       **{flag: True})
        opt = OptimizerSettings(name, momentum=momentum)
        runs = make_rule(make_plan(c, SEED, SHAPES), c, opt).updates
        try:
            load_config(None, overrides, environ={})
            loads = True
        except ConfigError as exc:
            assert str(exc).startswith(f"comm.{flag}=true does nothing with "), exc
            loads = False
        assert loads == runs, overrides


def test_code_that_builds_an_exchange_itself_may_turn_both_rules_on():
    """Outside the config (a user's own loop), the optimizer picks its rule of the two."""
    c = comm("topk")
    plan = make_plan(c, SEED, SHAPES)
    assert isinstance(make_rule(plan, c, SGD), DGC)
    assert isinstance(make_rule(plan, c, OptimizerSettings("adamw")), CompressedAdam)
    assert type(make_rule(plan, c, OptimizerSettings("sgd"))) is Rule  # no momentum to correct
