"""The torch compression kernels and exchange against the NumPy reference, in one process."""

from __future__ import annotations

import io

import horovod.torch as hvd
import numpy as np
import pytest
import torch

from hvdtrain.compression import make_plan
from hvdtrain.compression import reference as ref
from hvdtrain.compression.rules import OptimizerSettings
from hvdtrain.config import CommConfig, load_config
from hvdtrain.driver import train
from hvdtrain.exchange import Exchanged, ExchangeRequest
from hvdtrain.strategies.table import with_settings
from hvdtrain.torch import compression as tc
from hvdtrain.torch import exchange as tx
from tests.conftest import CONFIG, quiet_config
from tests.unit.numpy_world import Hub, NumpyExchange

hvd.init()
SEED = 5
SHAPES = [torch.Size([48, 40]), torch.Size([40]), torch.Size([7, 5, 6])]


def _grads(step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return [rng.standard_normal(tuple(s)).astype(np.float32) for s in SHAPES]


def _rule_grads(step: int) -> list[np.ndarray]:
    """:func:`_grads` with entries that are 0 for the first 2 steps (the rules' Adam warm-up): they
    have no variance to freeze, and large afterwards, so that top-k sends them."""
    grads = _grads(step)
    for g in grads:
        g.reshape(-1)[:8] *= 0 if step <= 2 else 10
    return grads


def test_kernels_match_the_reference():
    rng = np.random.default_rng(0)  # distinct magnitudes: ties may break either way in a kernel
    x = rng.permutation(np.linspace(0.01, 3, 997, dtype=np.float32)) * rng.choice([-1, 1], 997)
    x = x.astype(np.float32)
    values, idx = tc.topk_compress(torch.from_numpy(x), 25)
    ref_values, ref_idx = ref.topk_compress(x, 25)
    np.testing.assert_array_equal(idx.numpy(), ref_idx)
    np.testing.assert_array_equal(values.numpy(), ref_values)
    noise = np.random.default_rng(1).random(997, dtype=np.float32)
    for bucket in (0, 100):
        codes, scales = tc.qsgd_compress(torch.from_numpy(x), bucket, torch.from_numpy(noise))
        ref_codes, ref_scales = ref.qsgd_compress(x, bucket, noise)
        np.testing.assert_array_equal(codes.numpy(), ref_codes)
        np.testing.assert_array_equal(scales.numpy(), ref_scales)
        np.testing.assert_allclose(tc.qsgd_decompress(codes, scales, bucket).numpy(),
                                   ref.qsgd_decompress(ref_codes, ref_scales, bucket), rtol=1e-6)
    p = np.random.default_rng(2).standard_normal((30, 4)).astype(np.float32)
    np.testing.assert_allclose(tc.orthogonalize(torch.from_numpy(p)).numpy(), ref.orthogonalize(p),
                               atol=1e-5)
    idx = ref.randomk_indices(997, 30, seed=3, step=7, index=1)
    for scale in (1.0, ref.randomk_scale(997, 30, error_feedback=False)):
        np.testing.assert_array_equal(
            tc.randomk_compress(torch.from_numpy(x), torch.from_numpy(idx), scale).numpy(),
            ref.randomk_compress(x, idx, scale))
    # Three ranks' codes, one after another as an allgather concatenates them, decoded and averaged.
    per_rank = [ref.qsgd_compress(x * (r + 1), 100, noise) for r in range(3)]
    codes, scales = (torch.from_numpy(np.concatenate(part)) for part in zip(*per_rank, strict=True))
    np.testing.assert_allclose(tc.qsgd_mean(codes, scales, 100, 3).numpy(),
                               ref.qsgd_mean(per_rank, 100), rtol=0, atol=1e-6)


def _noise(step: int, index: int, n: int) -> np.ndarray:
    """qsgd's noise on rank 0: the torch kernel's draw from the reference's seed."""
    return tc.uniform(torch.tensor(ref.noise_seed(SEED, 0, step, index)), n).numpy()


def _reference_exchange(comm: CommConfig, steps: int) -> list[list[np.ndarray]]:
    """What one rank's exchange must produce per step, from the reference alone."""
    plan = make_plan(comm, SEED, SHAPES)
    residual: dict[int, np.ndarray] = {}
    q = {i: ref.powersgd_initial_q(s, comm.rank, SEED, i) for i, s in enumerate(SHAPES)}
    out = []
    for step in range(1, steps + 1):
        row = []
        for t, g in zip(plan.tensors, _grads(step), strict=True):
            i, n, shape = t.index, t.size, t.shape
            if not t.compressed:
                row.append(g)
                continue
            acc = ref.error_feedback(g.reshape(-1), residual.get(i) if plan.uses_feedback else None)
            if comm.compression == "topk":
                sent = mean = ref.sparse_mean([ref.topk_compress(acc, ref.num_selected(n, comm.ratio))], n)
            elif comm.compression == "randomk":
                k = ref.num_selected(n, comm.ratio)
                idx = ref.randomk_indices(n, k, SEED, step, i)
                vals = ref.randomk_compress(acc, idx, ref.randomk_scale(n, k, comm.error_feedback))
                sent = mean = ref.randomk_mean([vals], idx, n)
            elif comm.compression == "qsgd":
                u = _noise(step, i, n)
                sent = mean = ref.qsgd_mean([ref.qsgd_compress(acc, comm.bucket, u)], comm.bucket)
            else:
                m = acc.reshape(ref.matrix_shape(shape))
                mean, q[i], local = ref.powersgd_mean([m], q[i])
                sent, mean = local[0].reshape(-1), mean.reshape(-1)
            residual[i] = ref.new_residual(acc, sent)
            row.append(mean.reshape(shape))
        out.append(row)
    return out


def _exchange(comm: CommConfig, seed: int = SEED) -> tc.CompressingExchange:
    return tc.make_compressing(comm, seed, hvd.rank(), hvd.size(), [torch.zeros(s) for s in SHAPES])


def test_update_rule_kernels_match_the_reference():
    x = np.random.default_rng(3).standard_normal(500).astype(np.float32)
    idx = np.array([0, 7, 499, 250], np.int32)
    np.testing.assert_array_equal(tc.zero_at(torch.from_numpy(x), torch.from_numpy(idx)).numpy(),
                                  ref.zero_at(x, idx))
    x[idx] = 0
    np.testing.assert_array_equal(tc.fill_zeros(torch.from_numpy(x), torch.from_numpy(-x - 1)).numpy(),
                                  ref.fill_zeros(x, -x - 1))
    parts = [x[:100].reshape(10, 10), x[100:]]
    for max_norm in (0.5, 1e6):
        got = tc.clip_factor([torch.from_numpy(p) for p in parts], max_norm)
        assert float(got) == pytest.approx(float(ref.clip_factor(parts, max_norm)), rel=1e-6)


RULES = {
    "dgc-topk": (CommConfig(compression="topk", ratio=0.05, min_size=100, clip_norm=2.0,
                            sparsity_warmup_steps=3, momentum_correction=True),
                 OptimizerSettings("sgd", 0.9, 0.01)),
    "dgc-randomk-nomask": (CommConfig(compression="randomk", ratio=0.1, min_size=100,
                                      momentum_masking=False, momentum_correction=True),
                           OptimizerSettings("sgd", 0.9)),
    "adamw-topk": (CommConfig(compression="topk", ratio=0.05, min_size=100, dense_steps=2,
                              compress_momentum=True),
                   OptimizerSettings("adamw", weight_decay=0.1)),
    "adam-randomk": (CommConfig(compression="randomk", ratio=0.1, min_size=100,
                                dense_steps=2, compress_momentum=True),
                     OptimizerSettings("adam", weight_decay=0.1)),
}


@pytest.mark.parametrize("rule", RULES)
def test_update_rules_match_the_reference_exchange(rule):
    """The torch exchange against the same plan and rule run on the reference kernels."""
    comm, opt = RULES[rule]
    weights = [np.random.default_rng(9).standard_normal(tuple(s)).astype(np.float32)
               for s in SHAPES]
    params = [torch.from_numpy(w.copy()) for w in weights]
    exchange = tc.make_compressing(comm, SEED, hvd.rank(), hvd.size(), params, opt)
    reference = NumpyExchange(make_plan(comm, SEED, SHAPES), 0, 1, Hub(1), opt, lambda: weights)
    assert exchange.rule.updates and type(exchange.rule) is type(reference.rule)
    for step in range(1, 6):
        grads = _rule_grads(step)
        got = exchange.run([torch.from_numpy(g) for g in grads])
        want = reference.run(grads)
        for i, (x, w) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_allclose(x.numpy(), w, rtol=1e-4, atol=1e-5,
                                       err_msg=f"{rule} step {step} #{i}")


def made(c: CommConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Exchanged:
    """The exchange of ``c`` at one rank and the optimizer the step drives, as a run's are made:
    by the factory the strategies' registry names (:func:`hvdtrain.torch.exchange.make_exchange`)."""
    cfg = with_settings(load_config(None, [], environ={}), {"comm.compression": c.compression})
    return tx.make_exchange(cfg, ExchangeRequest(c, 0, 0, 1, list(model.parameters()),
                                                 optimizer=optimizer, model=model))


def test_the_optimizer_becomes_plain_sgd_where_the_exchange_applies_the_rule():
    model = torch.nn.Linear(200, 10)
    comm = CommConfig(compression="topk", momentum_correction=True, compress_momentum=True)
    for optimizer in [
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
            torch.optim.Adam(model.parameters(), lr=0.1, weight_decay=0.01),
            torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)]:
        _, used = made(comm, model, optimizer)
        assert type(used) is torch.optim.SGD
        group = used.param_groups[0]
        assert (group["momentum"], group["weight_decay"]) == (0, 0)  # both in the directions
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for method, off in [("qsgd", ()), ("topk", ("momentum_correction",))]:
        c = CommConfig(compression=method, **{name: False for name in off})
        exchange, used = made(c, model, sgd)
        assert used is sgd and not exchange.rule.updates


def test_qsgd_noise_is_a_function_of_its_seed():
    first = tc.uniform(torch.tensor(7), 1000)
    assert torch.equal(first, tc.uniform(torch.tensor(7), 1000))
    assert not torch.equal(first, tc.uniform(torch.tensor(8), 1000))
    assert first.dtype == torch.float32 and first.min() >= 0 and first.max() < 1


@pytest.mark.parametrize("comm", [
    CommConfig(compression="topk", ratio=0.05, min_size=100),
    CommConfig(compression="randomk", ratio=0.1, min_size=100),
    CommConfig(compression="randomk", ratio=0.1, min_size=100, error_feedback=False),
    CommConfig(compression="qsgd", bucket=64, min_size=100),
    CommConfig(compression="powersgd", rank=2, min_size=100),
], ids=["topk", "randomk", "randomk-noEF", "qsgd", "powersgd"])
def test_exchange_matches_the_reference_over_steps_and_resumes_exactly(comm):
    exchange = _exchange(comm)
    expected = _reference_exchange(comm, steps=4)
    for step in range(3):
        got = exchange.run([torch.from_numpy(g) for g in _grads(step + 1)])
        for x, want in zip(got, expected[step], strict=True):
            np.testing.assert_allclose(x.numpy(), want, rtol=1e-4, atol=1e-5)
    assert 0 < exchange.stats["wire_bytes"] < exchange.stats["dense_bytes"]
    # The state goes through torch.save / weights_only load, as in a checkpoint.
    buffer = io.BytesIO()
    torch.save(tc.to_torch(exchange.state_dict()), buffer)
    buffer.seek(0)
    restored = _exchange(comm)
    restored.load_state_dict(torch.load(buffer, weights_only=True), "test")
    restored.broadcast()
    a = exchange.run([torch.from_numpy(g) for g in _grads(4)])
    b = restored.run([torch.from_numpy(g) for g in _grads(4)])
    for x, y, want in zip(a, b, expected[3], strict=True):
        assert torch.equal(x, y)
        np.testing.assert_allclose(x.numpy(), want, rtol=1e-4, atol=1e-5)


def test_wire_bytes_are_those_of_the_tensors_sent():
    comm = CommConfig(compression="topk", ratio=0.01, min_size=100)
    topk = tc.make_compressing(comm, 0, hvd.rank(), hvd.size(), [torch.zeros(s) for s in SHAPES])
    topk.run([torch.from_numpy(g) for g in _grads(1)])
    k0, k2 = ref.num_selected(1920, 0.01), ref.num_selected(210, 0.01)
    assert topk.stats["wire_bytes"] == 8 * (k0 + k2) + 4 * 40 == topk.plan.wire_bytes()
    assert topk.stats["dense_bytes"] == 4 * (1920 + 40 + 210)
    frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    params = [torch.nn.Parameter(torch.zeros(10)), frozen]
    assert tx.bytes_per_step(tx.horovod_compression("fp16"), params) == (20, 40)
    assert tx.bytes_per_step(tx.horovod_compression("none"), params) == (40, 40)
    assert tx.horovod_compression("none") is not None and tx.horovod_compression("topk") is None


# The first run stops at step 25 by train.max_steps: a constant learning rate and no dense start
# by fraction (both depend on the run's length) keep it the same run as the whole one.
EXACT = ("train.epochs=1", "optim.schedule=constant", "checkpoint.every_steps=20", "comm.min_size=0",
         "train.backward_passes_per_step=2", "data.batch_size=16", "comm.dense_steps=0")


RESUMED = {"randomk": "comm.compression=randomk", "qsgd": "comm.compression=qsgd",
           "powersgd": "comm.compression=powersgd",
           "topk": "comm.compression=topk,comm.momentum_correction=true,comm.sparsity_warmup_steps=30,"
                   "comm.clip_norm=1",
           "topk-adamw": "comm.compression=topk,optim.name=adamw,optim.lr=0.002,"
                         "optim.weight_decay=0.01,comm.dense_steps=20,comm.compress_momentum=true"}
"""topk runs DGC (with its warm-up and clipping), randomk plain error feedback; topk-adamw
compresses AdamW's momentum after 20 dense steps: the checkpoint at step 25 holds them all."""


@pytest.mark.parametrize("method", RESUMED)
def test_training_resumes_bit_identically_with_compression_state(tmp_path, method):
    comm = RESUMED[method].split(",")
    straight = train(quiet_config(CONFIG, tmp_path / "a", *EXACT, *comm))
    stats = straight.engine.step_stats()
    assert {"data_s", "compute_s", "comm_s", "wire_bytes", "dense_bytes"} <= set(stats)
    assert 0 < stats["wire_bytes"] < stats["dense_bytes"]
    train(quiet_config(CONFIG, tmp_path / "b", *EXACT, *comm, "train.max_steps=25"))
    ckpt = torch.load(tmp_path / "b" / "run" / "checkpoints" / "step-00000025.ckpt",
                      weights_only=True)
    assert int(ckpt["compression"]["step"]) == 25
    assert ckpt["compression"]["method"] == method.split("-")[0]
    resumed = train(quiet_config(CONFIG, tmp_path / "b", *EXACT, *comm, "checkpoint.resume=auto"))
    assert resumed.summary["steps"] == straight.summary["steps"] == 45
    for key, value in straight.engine.parameters().items():
        assert np.array_equal(resumed.engine.parameters()[key], value), key


def test_qsgd_level_at_the_scale_stays_in_int8():
    codes, _ = tc.qsgd_compress(torch.tensor([1.0, 0.5]), 0, torch.tensor([0.999999, 0.1]))
    assert codes.tolist() == [127, 63]
