"""TensorFlow compression kernels and exchange against the NumPy reference, in one process.

The exchange runs with Horovod at size 1, where the mean over ranks is this rank's own
contribution; the two-rank means are checked in ``tests/multirank/test_compression.py``.
"""

from __future__ import annotations

import json

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.compression import make_plan
from hvdtrain.compression import reference as ref
from hvdtrain.compression.rules import OptimizerSettings
from hvdtrain.config import CommConfig, load_config
from hvdtrain.driver import train
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import ExchangeRequest, GradientExchange
from hvdtrain.strategies.table import with_settings
from hvdtrain.tensorflow import compression as tfc
from hvdtrain.tensorflow import exchange as tfx
from tests.conftest import TF_CONFIG, quiet_config
from tests.unit.numpy_world import Hub, NumpyExchange

F32 = np.float32
# Two matrices that every method compresses, a bias that travels dense (under min_size), a
# 1x80 matrix that PowerSGD leaves dense (rank 2 factors would not be smaller), and a Keras
# convolution kernel (kh, kw, in, out), which PowerSGD factors as 36 x 8 (outputs last).
SHAPES = [(24, 16), (16,), (16, 10), (1, 80), (3, 3, 4, 8)]
OUT_LAST = tfc.Kernels.out_last
METHODS = ["none", "fp16", "topk", "randomk", "qsgd", "powersgd"]


@pytest.fixture(scope="module", autouse=True)
def horovod_size_one():
    hvd.init()
    assert hvd.size() == 1


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# kernels ----------------------------------------------------------------------------------------

def test_topk_matches_the_reference_keeps_the_k_largest_and_breaks_ties_by_index():
    # Integers in [-3, 3]: heavy ties in magnitude, so the lower-index rule decides.
    for x in (rng().standard_normal(1000).astype(F32), rng(1).integers(-3, 4, 500).astype(F32)):
        for k in (1, 7, 100, x.size):
            values, idx = tfc.topk_compress(tf.constant(x), k)
            ref_values, ref_idx = ref.topk_compress(x, k)
            np.testing.assert_array_equal(idx.numpy(), ref_idx)
            np.testing.assert_array_equal(values.numpy(), ref_values)
            assert idx.dtype == tf.int32 and len(set(idx.numpy())) == k
            dropped = np.delete(np.abs(x), idx.numpy())
            assert dropped.size == 0 or np.abs(values.numpy()).min() >= dropped.max()


def test_scatter_adds_repeated_indices_like_the_reference():
    values, idx = rng().standard_normal(6).astype(F32), np.array([0, 2, 2, 5, 0, 9], np.int32)
    np.testing.assert_array_equal(tfc.scatter(tf.constant(values), tf.constant(idx), 10).numpy(),
                                  ref.scatter(values, idx, 10))


def test_randomk_matches_the_reference():
    x = rng().standard_normal(300).astype(F32)
    idx = ref.randomk_indices(300, 30, seed=3, step=7, index=1)
    for scale in (1.0, ref.randomk_scale(300, 30, error_feedback=False)):
        np.testing.assert_array_equal(tfc.randomk_compress(tf.constant(x), tf.constant(idx), scale),
                                      ref.randomk_compress(x, idx, scale))


@pytest.mark.parametrize("bucket", [0, 7, 128, 512])
def test_qsgd_matches_the_reference(bucket):
    x = rng().standard_normal(1000).astype(F32)
    x[130:260] = 0.0  # a bucket of zeros (scale 0) for bucket 128
    noise = rng(1).random(1000, dtype=F32)
    codes, scales = tfc.qsgd_compress(tf.constant(x), bucket, tf.constant(noise))
    ref_codes, ref_scales = ref.qsgd_compress(x, bucket, noise)
    assert codes.dtype == tf.int8 and scales.shape == (ref.qsgd_buckets(1000, bucket),)
    np.testing.assert_array_equal(codes.numpy(), ref_codes)
    np.testing.assert_array_equal(scales.numpy(), ref_scales)
    np.testing.assert_array_equal(tfc.qsgd_decompress(codes, scales, bucket).numpy(),
                                  ref.qsgd_decompress(ref_codes, ref_scales, bucket))
    # Three ranks' codes decoded together (the layout of an allgather) and averaged.
    per_rank = [ref.qsgd_compress(x * (r + 1), bucket, noise) for r in range(3)]
    stacked = tfc.qsgd_decompress(tf.constant(np.stack([c for c, _ in per_rank])),
                                  tf.constant(np.stack([s for _, s in per_rank])), bucket)
    np.testing.assert_allclose(tfc.rank_mean(stacked).numpy(), ref.qsgd_mean(per_rank, bucket),
                               rtol=0, atol=1e-6)


def test_orthogonalize_matches_the_reference_and_keeps_a_zero_column_zero():
    p = rng().standard_normal((50, 4)).astype(F32)
    p[:, 2] = 0.0
    out = tfc.orthogonalize(tf.constant(p)).numpy()
    np.testing.assert_allclose(out, ref.orthogonalize(p), rtol=0, atol=1e-5)
    assert np.all(out[:, 2] == 0.0)
    kept = out[:, [0, 1, 3]]
    np.testing.assert_allclose(kept.T @ kept, np.eye(3), atol=1e-5)


def test_powersgd_kernels_at_full_rank_reproduce_the_mean():
    """Two simulated ranks through the TensorFlow kernels: P = orth(mean(M Q)), Q = mean(M^T P)."""
    matrices = [rng(r).standard_normal((12, 5)).astype(F32) for r in range(2)]
    q = tf.constant(ref.powersgd_initial_q((12, 5), 5, seed=0, index=0))
    p = tfc.orthogonalize(tfc.rank_mean(tf.stack([m @ q for m in matrices])))
    new_q = tfc.rank_mean(tf.stack([tf.transpose(m) @ p for m in matrices]))
    np.testing.assert_allclose((p @ tf.transpose(new_q)).numpy(), ref.dense_mean(matrices),
                               rtol=0, atol=1e-5)


# unbiasedness -----------------------------------------------------------------------------------

def test_qsgd_is_unbiased():
    """The mean of T decodings of x lies within 7 bounds of x, element by element.

    A decoded element is x + e with E[e] = 0 (E[floor(y + u)] = y) and |e| <= s/127 (s: its
    bucket's scale), so by Hoeffding P(|mean_T e| >= c s / (127 sqrt(T))) <= 2 exp(-c^2 / 2):
    with c = 7 and 2,000 elements the chance of any false alarm is below 5e-8. Rounding to
    nearest instead (u = 0.5, a biased code) misses by up to s/254, well outside the bound, and
    the test asserts that too, so it can fail.
    """
    n, bucket, trials = 2048, 512, 400
    x = rng().standard_normal(n).astype(F32)
    scales = ref.qsgd_compress(x, bucket, np.zeros(n, F32))[1]
    bound = 7 * np.repeat(scales, bucket) / 127 / np.sqrt(trials)

    def mean_error(noise: np.ndarray) -> np.ndarray:
        # All trials in one call: n is a whole number of buckets, so copies never share one.
        tiled = tf.constant(np.tile(x, trials))
        codes, s = tfc.qsgd_compress(tiled, bucket, tf.constant(noise.reshape(-1)))
        decoded = tfc.qsgd_decompress(codes, s, bucket).numpy().reshape(trials, n)
        return np.abs(decoded.mean(axis=0, dtype=np.float64) - x)

    assert np.all(mean_error(rng(1).random((trials, n), dtype=F32)) < bound)
    assert np.any(mean_error(np.full((trials, n), 0.5, F32)) > bound)


def test_randomk_without_error_feedback_is_unbiased():
    """Each entry is kept with probability k/n and scaled by n/k, so its estimate has mean x and
    standard deviation |x| sqrt(n/k - 1); the mean of T steps' estimates, standardised, is close
    to N(0, 1) (T = 3,000 binomial draws of p = 0.1). |z| < 6 for all 500 entries fails by chance
    with probability about 1e-6; leaving out the n/k scale gives z of about 0.9 sqrt(T) / 3 = 16.
    """
    n, ratio, trials = 500, 0.1, 3000
    x = rng().standard_normal(n).astype(F32)
    k = ref.num_selected(n, ratio)
    scale = ref.randomk_scale(n, k, error_feedback=False)
    idx = tf.constant(np.stack([ref.randomk_indices(n, k, seed=0, step=step, index=0)
                                for step in range(1, trials + 1)]))
    values = tfc.randomk_compress(tf.constant(x), idx, scale)  # (trials, k): every step at once
    total = tfc.scatter(tf.reshape(values, [-1]), tf.reshape(idx, [-1]), n).numpy()
    z = (total / trials - x) / (np.abs(x) * np.sqrt(n / k - 1) / np.sqrt(trials))
    assert np.max(np.abs(z)) < 6


# the exchange at size 1 against the reference ---------------------------------------------------

def comm(method: str, **kw) -> CommConfig:
    return CommConfig(compression=method, **{"ratio": 0.1, "min_size": 64, "rank": 2, **kw})


def made(c: CommConfig, seed: int) -> GradientExchange:
    """The exchange of ``c`` at one rank, as a run's is made: by the factory the strategies'
    registry names for its method (:func:`hvdtrain.tensorflow.exchange.make_exchange`)."""
    cfg = with_settings(load_config(None, ["framework=tensorflow"], environ={}),
                        {"comm.compression": c.compression})
    params = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    exchange, optimizer = tfx.make_exchange(cfg, ExchangeRequest(c, seed, 0, 1, params))
    assert optimizer is None  # none given: the exchange's kind keeps the run's
    return exchange


def grads_of(step: int) -> list[np.ndarray]:
    return [rng(step * 10 + i).standard_normal(s).astype(F32) for i, s in enumerate(SHAPES)]


def rule_grads(step: int) -> list[np.ndarray]:
    """:func:`grads_of` with entries that are 0 for the first 2 steps (the rules' Adam warm-up):
    they have no variance to freeze, and large afterwards, so that top-k sends them."""
    grads = grads_of(step)
    for g in grads:
        g.reshape(-1)[:8] *= 0 if step <= 2 else 10
    return grads


class Reference:
    """One rank's exchange in NumPy, from the reference functions, with its own residuals and Q."""

    def __init__(self, c: CommConfig, seed: int) -> None:
        self.c, self.seed = c, seed
        self.residuals: dict[int, np.ndarray] = {}
        self.q = {i: ref.powersgd_initial_q(s, c.rank, seed, i, OUT_LAST)
                  for i, s in enumerate(SHAPES)}

    def run(self, grads: list[np.ndarray], step: int, noise) -> list[np.ndarray]:
        return [self.one(i, g, step, noise) for i, g in enumerate(grads)]

    def one(self, i: int, g: np.ndarray, step: int, noise) -> np.ndarray:
        c, n = self.c, g.size
        if not make_plan(c, self.seed, SHAPES, out_last=OUT_LAST).tensors[i].compressed:
            return g  # the dense mean over one rank (none and fp16 skip the exchange at size 1)
        if c.compression == "qsgd":
            codes, scales = ref.qsgd_compress(g, c.bucket, noise(step, i, n))
            return ref.qsgd_mean([(codes, scales)], c.bucket).reshape(g.shape)
        acc = ref.error_feedback(g.reshape(-1), self.residuals.get(i) if c.error_feedback else None)
        k = ref.num_selected(n, c.ratio)
        if c.compression == "topk":
            sent = ref.sparse_mean([ref.topk_compress(acc, k)], n)
        elif c.compression == "randomk":
            idx = ref.randomk_indices(n, k, self.seed, step, i)
            values = ref.randomk_compress(acc, idx, ref.randomk_scale(n, k, c.error_feedback))
            sent = ref.randomk_mean([values], idx, n)
        else:
            matrix = acc.reshape(ref.matrix_shape(g.shape, OUT_LAST))
            mean, self.q[i], (own,) = ref.powersgd_mean([matrix], self.q[i])
            sent = own.reshape(-1)
            np.testing.assert_allclose(mean.reshape(-1), sent, atol=1e-6)  # one rank: mean = own
        self.residuals[i] = ref.new_residual(acc, sent)
        return sent.reshape(g.shape)


@pytest.mark.parametrize("method, feedback", [(m, True) for m in METHODS] + [
    (m, False) for m in ("topk", "randomk", "powersgd")])
def test_exchange_matches_the_reference_and_conserves_with_error_feedback(method, feedback):
    c = comm(method, error_feedback=feedback)
    exchange = made(c, 5)
    reference = Reference(c, seed=5)
    noise = lambda step, i, n: tfc.uniform(  # noqa: E731
        tf.constant(ref.noise_seed(5, 0, step, i), tf.int64), n).numpy()
    for step in range(1, 4):
        grads = grads_of(step)
        before = residuals(exchange)
        out = [t.numpy() for t in exchange.run([tf.constant(g) for g in grads])]
        expected = reference.run(grads, step, noise)
        for i, (o, e) in enumerate(zip(out, expected, strict=True)):
            np.testing.assert_allclose(o, e, rtol=0, atol=2e-6, err_msg=f"{method} step {step} #{i}")
        for i, residual in residuals(exchange).items():
            # Nothing is lost, only late: sent + new residual = old residual + gradient.
            np.testing.assert_allclose(out[i].reshape(-1) + residual,
                                       before[i] + grads[i].reshape(-1), rtol=0, atol=1e-6)
            np.testing.assert_allclose(residual, reference.residuals[i], rtol=0, atol=2e-6)
    compressed = [t.index for t in exchange.plan.tensors if t.compressed]
    has_residuals = feedback and method in ("topk", "randomk", "powersgd")
    assert sorted(residuals(exchange)) == (compressed if has_residuals else [])


def residuals(exchange: tfc.CompressingExchange) -> dict[int, np.ndarray]:
    """The exchange's error-feedback residuals by tensor index."""
    return {s.index: exchange.store.numpy(s.key) for s in exchange.slots if s.kind == "residual"}


def test_qsgd_noise_is_a_function_of_its_seed():
    first = tfc.uniform(tf.constant(7, tf.int64), 1000).numpy()
    np.testing.assert_array_equal(first, tfc.uniform(tf.constant(7, tf.int64), 1000).numpy())
    assert not np.array_equal(first, tfc.uniform(tf.constant(8, tf.int64), 1000).numpy())
    assert first.dtype == F32 and first.min() >= 0 and first.max() < 1


def expected_wire_bytes(c: CommConfig) -> int:
    """Bytes per rank per step from the reference's wire formulas."""
    total = 0
    for s, t in zip(SHAPES, make_plan(c, 0, SHAPES, out_last=OUT_LAST).tensors, strict=True):
        n = int(np.prod(s))
        if not t.compressed:
            total += 4 * n
        elif c.compression == "topk":
            total += 8 * ref.num_selected(n, c.ratio)
        elif c.compression == "randomk":
            total += 4 * ref.num_selected(n, c.ratio)
        elif c.compression == "qsgd":
            total += n + 4 * ref.qsgd_buckets(n, c.bucket)
        else:
            rows, cols = ref.matrix_shape(s, OUT_LAST)
            total += 4 * min(c.rank, rows, cols) * (rows + cols)
    return total


@pytest.mark.parametrize("method", METHODS)
def test_stats_count_the_bytes_sent(method):
    c = comm(method, bucket=100)
    exchange = made(c, 0)
    exchange.run([tf.constant(g) for g in grads_of(1)])
    if method in ("none", "fp16"):
        # One rank: nothing to average, so nothing is sent (as Horovod's optimizers do); the
        # two-rank test checks their bytes (fp16: exactly half).
        assert {k: v for k, v in exchange.stats.items() if k != "compress_s"} == {
            "wire_bytes": 0.0, "dense_bytes": 0.0, "comm_s": 0.0}
        return
    assert exchange.stats["dense_bytes"] == 4 * sum(int(np.prod(s)) for s in SHAPES)
    assert exchange.stats["wire_bytes"] == expected_wire_bytes(c) == exchange.plan.wire_bytes()
    assert exchange.stats["comm_s"] > 0


def test_state_round_trip_is_exact():
    """A PowerSGD exchange's checkpoint entry restores step, Q and residuals into a fresh one."""
    c = comm("powersgd")
    first = made(c, 1)
    for step in range(1, 3):
        first.run([tf.constant(g) for g in grads_of(step)])
    first.gather()
    arrays = first.state_dict()
    assert str(arrays["method"]) == "powersgd" and int(arrays["step"]) == 2
    second = made(c, 1)
    second.load_state_dict(arrays, "test")
    second.broadcast()
    assert second.step == 2 and sorted(residuals(second)) == sorted(residuals(first)) == [0, 2, 4]
    for s in first.slots:
        np.testing.assert_array_equal(first.store.numpy(s.key), second.store.numpy(s.key))
    grads = [tf.constant(g) for g in grads_of(3)]
    for x, y in zip(first.run(grads), second.run(grads), strict=True):
        np.testing.assert_array_equal(x.numpy(), y.numpy())
    # Written at 3 ranks, resumed at 1: the rank gets the mean, so the update owed is unchanged.
    at_three = {k: np.stack([v[0], 2 * v[0], 3 * v[0]]) if k.startswith("residual/") else v
                for k, v in arrays.items()}
    third = made(c, 1)
    third.load_state_dict(at_three, "test")
    third.broadcast()
    for i, residual in residuals(third).items():
        np.testing.assert_allclose(residual, 2 * arrays[f"residual/{i}"][0], rtol=1e-6)
    wrong_q = {**arrays, "q/4": np.zeros((96, 2), F32)}  # Keras's kernel height as the rows
    with pytest.raises(HvdtrainError, match=r"compression state q/4 has shape \(96, 2\), this "
                                            r"run's is \(8, 2\)"):
        made(c, 1).load_state_dict(wrong_q, "x")
    with pytest.raises(HvdtrainError, match="compression state is for 'powersgd'"):
        made(comm("topk"), 1).load_state_dict(
            arrays, "x")


# the trainer ------------------------------------------------------------------------------------

RESUMED = {"randomk": (), "powersgd": (), "qsgd": (),
           "topk-dgc": ("comm.momentum_correction=true", "comm.sparsity_warmup_steps=80",
                        "comm.clip_norm=1", "comm.momentum_masking=true"),
           "topk-adamw": ("optim.name=adamw", "optim.lr=0.002", "optim.weight_decay=0.01",
                          "comm.dense_steps=50", "comm.compress_momentum=true")}
"""topk-dgc runs DGC with its density warm-up, clipping and masking (the checkpoint at step 60
falls in the warm-up's last stage); topk-adamw compresses AdamW's momentum after 50 dense steps."""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", RESUMED)
def test_resume_with_compression_state_is_bit_identical(tmp_path, run):
    """Interrupted at step 60 (mid-epoch, 45 steps each) and resumed with two micro-batches per
    step: the residuals, Q, the update rules' velocities, momenta and frozen variance, and the
    step that seeds random-k and qsgd's noise come back exactly."""
    method = run.split("-")[0]
    common = ("train.epochs=2", "optim.schedule=constant", "checkpoint.every_steps=30",
              "train.backward_passes_per_step=2", "data.batch_size=16", f"comm.compression={method}",
              "comm.min_size=512", "log.tensorboard=false",
              # stopped by train.max_steps: no dense start by fraction (it depends on the length)
              "comm.dense_steps=0", *RESUMED[run])
    straight = train(quiet_config(TF_CONFIG, tmp_path / "a", *common))
    train(quiet_config(TF_CONFIG, tmp_path / "b", *common, "train.max_steps=60"))
    resumed = train(quiet_config(TF_CONFIG, tmp_path / "b", *common, "checkpoint.resume=auto"))
    assert resumed.summary["steps"] == straight.summary["steps"] == 90
    for key, value in straight.engine.parameters().items():
        assert np.array_equal(resumed.engine.parameters()[key], value), f"{method}: {key}"
    with np.load(tmp_path / "b" / "run" / "checkpoints" / "step-00000060.ckpt") as ckpt:
        kinds = {k.split("/")[1] for k in ckpt.files if k.startswith("compression/")}
    rule = {"topk-dgc": {"velocity", "momentum"}, "topk-adamw": {"momentum", "variance"}}.get(run)
    if rule:  # the exchange applies the rule; the optimizer is plain SGD
        assert rule <= kinds and "residual" in kinds
        assert straight.engine.optimizer.get_config()["momentum"] == 0.0
        assert straight.engine.kernels.l2 == 0.0
    summary = json.loads((tmp_path / "a" / "run" / "summary.json").read_text())
    # It learns; chance is 0.1.
    assert summary["compression"] == method and summary["final"]["eval_accuracy"] >= 0.5
    stats = straight.engine.step_stats()
    assert set(stats) == {"data_s", "compute_s", "comm_s", "compress_s", "wire_bytes", "dense_bytes",
                          "skipped"}
    assert 0 < stats["compress_s"] < stats["compute_s"]
    assert stats["dense_bytes"] == 4 * sum(v.size for v in straight.engine.parameters().values())
    assert 0 < stats["wire_bytes"] < stats["dense_bytes"] / 3 and stats["comm_s"] > 0


def test_qsgd_level_at_the_scale_stays_in_int8():
    codes, _ = tfc.qsgd_compress(tf.constant([1.0, 0.5]), 0, tf.constant([0.999999, 0.1]))
    assert codes.numpy().tolist() == [127, 63]


def test_update_rule_kernels_match_the_reference():
    x = np.random.default_rng(3).standard_normal(500).astype(np.float32)
    idx = np.array([0, 7, 499, 250], np.int32)
    np.testing.assert_array_equal(tfc.zero_at(tf.constant(x), tf.constant(idx)).numpy(),
                                  ref.zero_at(x, idx))
    x[idx] = 0
    np.testing.assert_array_equal(tfc.fill_zeros(tf.constant(x), tf.constant(-x - 1)).numpy(),
                                  ref.fill_zeros(x, -x - 1))
    parts = [x[:100].reshape(10, 10), x[100:]]
    for max_norm in (0.5, 1e6):
        got = tfc.clip_factor([tf.constant(p) for p in parts], max_norm)
        assert float(got) == pytest.approx(float(ref.clip_factor(parts, max_norm)), rel=1e-6)


RULES = {
    "dgc-topk": (comm("topk", ratio=0.05, clip_norm=2.0, sparsity_warmup_steps=3,
                      momentum_masking=True, momentum_correction=True),
                 OptimizerSettings("sgd", 0.9, 0.01)),
    "dgc-randomk": (comm("randomk", momentum_correction=True, sparsity_warmup_steps=2),
                    OptimizerSettings("sgd", 0.9)),
    "adamw-topk": (comm("topk", ratio=0.05, dense_steps=2, compress_momentum=True),
                   OptimizerSettings("adamw", weight_decay=0.1)),
    "adam-qsgd": (comm("qsgd", dense_steps=2, compress_momentum=True),
                  OptimizerSettings("adam", weight_decay=0.1)),
}


@pytest.mark.parametrize("rule", RULES)
def test_update_rules_match_the_reference_exchange(rule):
    """The TensorFlow exchange with an update rule against the same plan and rule run on the
    reference kernels, over the rule's phases (density or Adam warm-up, then compressed), with the
    weights changing between steps; the stages are traced once per phase, not once per step."""
    c, opt = RULES[rule]
    weights = [rng(9 + i).standard_normal(s).astype(F32) for i, s in enumerate(SHAPES)]
    variables = [tf.Variable(w) for w in weights]
    exchange = tfc.make_compressing(c, 5, 0, 1, SHAPES, opt, lambda: variables)
    reference = NumpyExchange(make_plan(c, 5, SHAPES), 0, 1, Hub(1), opt, lambda: weights)
    if c.compression == "qsgd":  # the same noise: the TensorFlow kernel's draw from the same seed
        reference.kernels = type("Kernels", (type(reference.kernels),), {"uniform": staticmethod(
            lambda seed, n: tfc.uniform(tf.constant(seed, tf.int64), n).numpy())})()
    assert exchange.rule.updates and type(exchange.rule) is type(reference.rule)
    assert tfx.applies_update(exchange)
    steps = 6
    for step in range(1, steps + 1):
        grads = rule_grads(step)
        got = [t.numpy() for t in exchange.run([tf.constant(g) for g in grads])]
        want = reference.run(grads)
        for i, (x, w) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_allclose(x, w, rtol=1e-4, atol=1e-5,
                                       err_msg=f"{rule} step {step} #{i}")
        for i, d in enumerate(want):  # the SGD step the optimizer takes with the directions
            weights[i] -= F32(0.1) * d
            variables[i].assign(weights[i])
    for key in exchange.store.variables:
        np.testing.assert_allclose(exchange.store.numpy(key), reference.store.numpy(key),
                                   rtol=1e-4, atol=1e-5, err_msg=key)
    phases = {exchange.rule.begin_step(step) for step in range(1, steps + 1)}
    assert len(phases) >= 2
    assert exchange._begin_fn.experimental_get_tracing_count() == len(phases)
