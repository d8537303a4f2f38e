"""The NumPy reference of the compressors: the properties each method promises."""

import numpy as np
import pytest

from hvdtrain.compression import METHODS, PLANS, make_plan, state
from hvdtrain.compression import reference as ref
from hvdtrain.config import CommConfig, load_config
from hvdtrain.errors import ConfigError, HvdtrainError


def _vec(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_topk_keeps_exactly_the_k_largest_magnitudes():
    x = _vec(1000)
    values, idx = ref.topk_compress(x, 10)
    assert idx.dtype == np.int32 and list(idx) == sorted(idx) and len(set(idx)) == 10
    threshold = np.sort(np.abs(x))[-10]
    assert set(idx) == set(np.flatnonzero(np.abs(x) >= threshold))
    np.testing.assert_array_equal(values, x[idx])


def test_topk_mean_sums_every_ranks_values_at_their_indices():
    a = (np.array([1.0, 2.0], np.float32), np.array([0, 3], np.int32))
    b = (np.array([4.0, 6.0], np.float32), np.array([3, 4], np.int32))
    np.testing.assert_array_equal(ref.sparse_mean([a, b], 5), [0.5, 0, 0, 3.0, 3.0])


def test_randomk_indices_are_shared_distinct_and_change_every_step():
    first = ref.randomk_indices(5000, 50, seed=3, step=1, index=2)
    assert np.array_equal(first, ref.randomk_indices(5000, 50, seed=3, step=1, index=2))
    assert len(set(first)) == 50 and list(first) == sorted(first) and first.dtype == np.int32
    for other in (dict(seed=3, step=2, index=2), dict(seed=3, step=1, index=3),
                  dict(seed=4, step=1, index=2)):
        assert not np.array_equal(first, ref.randomk_indices(5000, 50, **other))


def test_randomk_without_feedback_is_unbiased():
    # Each entry is picked with probability k/n and scaled by n/k: its estimate has mean x and
    # variance x^2 (n/k - 1). Over T draws the mean's standard error is |x| sqrt((n/k - 1) / T);
    # 5 standard errors are exceeded with probability < 1e-6 per entry (normal approximation).
    n, k, trials = 200, 20, 4000
    x = _vec(n)
    total = np.zeros(n)
    for step in range(1, trials + 1):
        idx = ref.randomk_indices(n, k, 0, step, 0)
        total += ref.randomk_mean([ref.randomk_compress(x, idx, ref.randomk_scale(n, k, False))],
                                  idx, n)
    bound = 5 * np.abs(x) * np.sqrt((n / k - 1) / trials)
    assert np.all(np.abs(total / trials - x) <= bound + 1e-6)
    # the same test catches a biased estimate: without the n/k factor the mean is x * k/n
    assert ref.randomk_scale(n, k, True) == 1.0


def test_qsgd_codes_are_int8_levels_and_unbiased():
    # Each decoded entry is scale/127 * (level or level+1), so its variance is at most
    # (scale/127)^2 / 4; over T draws, 5 standard errors bound the mean (p < 1e-6 per entry).
    n, bucket, trials = 300, 64, 3000
    x = _vec(n, seed=1)
    gen = np.random.default_rng(7)
    total = np.zeros(n)
    for _ in range(trials):
        codes, scales = ref.qsgd_compress(x, bucket, gen.random(n, dtype=np.float32))
        total += ref.qsgd_decompress(codes, scales, bucket)
    assert codes.dtype == np.int8 and np.abs(codes.astype(int)).max() <= ref.QSGD_LEVELS
    assert scales.shape == (ref.qsgd_buckets(n, bucket),)
    step = np.repeat(scales / ref.QSGD_LEVELS, bucket)[:n]
    assert np.all(np.abs(total / trials - x) <= 5 * step / 2 / np.sqrt(trials) + 1e-7)
    # round-to-nearest (u = 0.5 everywhere) is biased: the same bound fails for it
    codes, scales = ref.qsgd_compress(x, bucket, np.full(n, 0.5, np.float32))
    assert np.any(np.abs(ref.qsgd_decompress(codes, scales, bucket) - x)
                  > 5 * step / 2 / np.sqrt(trials))


def test_qsgd_level_at_the_scale_stays_in_int8():
    # float32: 127 + 0.999999 rounds to 128, which int8 would wrap to -128 (a flipped sign)
    codes, _ = ref.qsgd_compress(np.array([1.0, 0.5], np.float32), 0,
                                 np.array([0.999999, 0.1], np.float32))
    assert codes.tolist() == [127, 63]


def test_qsgd_one_scale_per_tensor_and_zero_tensor():
    codes, scales = ref.qsgd_compress(np.zeros(10, np.float32), 0, np.full(10, 0.9, np.float32))
    assert scales.shape == (1,) and not codes.any()


@pytest.mark.parametrize("method", ["topk", "randomk", "powersgd"])
def test_error_feedback_conserves_the_gradient(method):
    shape, n = (16, 32), 512
    residual, grad = _vec(n, 2) * 0.1, _vec(n, 3)
    acc = ref.error_feedback(grad, residual)
    if method == "topk":
        sent = ref.scatter(*ref.topk_compress(acc, 20), n)
    elif method == "randomk":
        idx = ref.randomk_indices(n, 20, 0, 1, 0)
        sent = ref.scatter(ref.randomk_compress(acc, idx, 1.0), idx, n)
    else:
        q = ref.powersgd_initial_q(shape, 2, 0, 0)
        sent = ref.powersgd_mean([acc.reshape(shape)], q)[2][0].reshape(-1)
    assert np.count_nonzero(sent) and not np.allclose(sent, acc)  # something was held back
    np.testing.assert_allclose(sent + ref.new_residual(acc, sent), residual + grad, atol=1e-6)


@pytest.mark.parametrize("shape", [(6, 9), (9, 6), (8, 2, 3)])
def test_powersgd_at_full_rank_is_the_exact_mean(shape):
    rng = np.random.default_rng(4)
    mats = [rng.standard_normal(ref.matrix_shape(shape)).astype(np.float32) for _ in range(3)]
    full = min(ref.matrix_shape(shape))
    approx, new_q, local = ref.powersgd_mean(mats, ref.powersgd_initial_q(shape, full, 0, 1))
    np.testing.assert_allclose(approx, ref.dense_mean(mats), atol=1e-5)
    np.testing.assert_allclose(ref.dense_mean(local), approx, atol=1e-5)
    assert new_q.shape == (ref.matrix_shape(shape)[1], full)


def test_matrix_shape_takes_a_layers_outputs_as_one_side():
    """A convolution's outputs by the rest, in PyTorch's layout and in Keras's (outputs last):
    the same matrix, transposed, never Keras's kernel height by the rest."""
    assert ref.matrix_shape((128, 64, 3, 3)) == (128, 576)
    assert ref.matrix_shape((3, 3, 64, 128), out_last=True) == (576, 128)
    assert ref.matrix_shape((64, 10), out_last=True) == ref.matrix_shape((64, 10)) == (64, 10)
    assert ref.powersgd_initial_q((3, 3, 64, 128), 2, 0, 0, out_last=True).shape == (128, 2)
    assert ref.low_rank_pays((3, 3, 4, 8), 2, out_last=True)


def test_powersgd_low_rank_is_an_orthogonal_projection():
    p = ref.orthogonalize(np.random.default_rng(5).standard_normal((20, 3)).astype(np.float32))
    np.testing.assert_allclose(p.T @ p, np.eye(3), atol=1e-5)


def test_noise_seeds_differ_by_rank_step_and_tensor_and_repeat():
    seeds = {ref.noise_seed(1, rank, step, index)
             for rank in range(3) for step in range(1, 4) for index in range(3)}
    assert len(seeds) == 27 and all(0 <= s < 2**63 for s in seeds)
    assert ref.noise_seed(1, 2, 3, 0) == ref.noise_seed(1, 2, 3, 0) != ref.noise_seed(2, 2, 3, 0)


@pytest.mark.parametrize("override,message", [
    ("comm.compression=bf16", "Horovod 0.28.1 cannot carry it"),
    ("comm.ratio=0", "comm.ratio=0.0: must be > 0"),
    ("comm.ratio=1.5", "comm.ratio=1.5: must be <= 1.0"),
    ("comm.rank=0", "comm.rank=0: must be >= 1"),
    ("comm.bucket=-1", "comm.bucket=-1: must be >= 0"),
    ("comm.compression=zip", "must be one of none, fp16, topk, randomk, qsgd, powersgd"),
])
def test_comm_config_is_validated(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config(None, [override], environ={})


def test_mnist1d_is_registered_and_generated_locally():
    # The benchmark's second dataset: the package's make_dataset with its defaults (no download).
    from hvdtrain.registry import DATASETS
    data = DATASETS.get("mnist1d")()
    assert data.spec().input_shape == (40,) and data.spec().num_classes == 10
    assert (len(data.train()), len(data.test())) == (4000, 1000)
    assert data.train().x.dtype == np.float32 and set(np.unique(data.train().y)) == set(range(10))


# the framework-free plans and state ------------------------------------------------------------

SHAPES = [(64, 128), (128,), (100,), (4, 4), (4096,)]


def _plan(method: str, **kw):
    return make_plan(CommConfig(compression=method, **{"min_size": 1024, "rank": 2, **kw}), 0, SHAPES)


def test_the_method_names_live_in_the_registry_and_config_validates_with_them():
    assert METHODS == ("none", "fp16", "topk", "randomk", "qsgd", "powersgd")
    assert tuple(sorted(PLANS)) == tuple(sorted(METHODS))
    with pytest.raises(HvdtrainError, match="unknown compression method 'zip'; known: fp16, none"):
        PLANS.get("zip")


def test_what_each_method_compresses():
    compressed = {m: [t.compressed for t in _plan(m).tensors] for m in METHODS}
    assert compressed["none"] == compressed["fp16"] == [False] * 5
    # under min_size: dense; PowerSGD also leaves vectors and matrices its factors do not shrink
    assert compressed["topk"] == compressed["randomk"] == compressed["qsgd"] == [
        True, False, False, False, True]
    assert compressed["powersgd"] == [True, False, False, False, False]
    assert [t.compressed for t in _plan("powersgd", min_size=0).tensors] == [
        True, False, False, False, False]
    assert _plan("topk", min_size=0).tensors[3].compressed
    assert ref.num_selected(8192, 0.01) == 81 and ref.num_selected(10, 0.01) == 1


def test_plans_count_the_bytes_each_method_promises():
    dense = 4 * (64 * 128 + 128 + 100 + 16 + 4096)
    uncompressed = 4 * (128 + 100 + 16)
    assert _plan("none").wire_bytes() == _plan("none").dense_bytes() == dense
    assert _plan("fp16").wire_bytes() * 2 == dense
    k = ref.num_selected(8192, 0.01), ref.num_selected(4096, 0.01)
    assert _plan("topk").wire_bytes() == 8 * sum(k) + uncompressed
    assert _plan("randomk").wire_bytes() == 4 * sum(k) + uncompressed
    assert _plan("qsgd", bucket=512).wire_bytes() == 8192 + 4 * 16 + 4096 + 4 * 8 + uncompressed
    assert _plan("powersgd").wire_bytes() == 4 * 2 * (64 + 128) + uncompressed + 4 * 4096
    assert {m: _plan(m).dense_bytes() for m in METHODS} == dict.fromkeys(METHODS, dense)


def test_each_methods_state():
    assert [s.key for s in _plan("topk").slots()] == ["residual/0", "residual/4"]
    assert _plan("topk", error_feedback=False).slots() == _plan("qsgd").slots() == []
    slots = _plan("powersgd").slots()
    assert [(s.key, s.per_rank) for s in slots] == [("residual/0", True), ("q/0", False)]
    np.testing.assert_array_equal(slots[1].initial, ref.powersgd_initial_q((64, 128), 2, 0, 0))
    assert [p.rounds for p in map(_plan, METHODS)] == [1, 1, 1, 1, 1, 2]


def test_resharding_keeps_each_ranks_rows_or_what_the_ranks_owe_together():
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert state.reshard(rows, 3) is rows
    for size in (1, 2, 5):
        out = state.reshard(rows, size)
        assert out.shape == (size, 4) and out.dtype == np.float32
        np.testing.assert_allclose(out.mean(axis=0), rows.mean(axis=0), rtol=1e-6)
        assert all(np.array_equal(r, out[0]) for r in out)


def test_a_checkpoint_entry_round_trips_and_refuses_another_methods_state():
    slots = _plan("powersgd").slots()
    entry = state.pack("powersgd", 7, {"q/0": np.ones((128, 2), np.float32),
                                       "residual/0": np.zeros((2, 8192), np.float32)})
    saved = state.unpack(entry, "powersgd", slots, "ckpt")
    assert saved.step == 7 and set(saved.shared) == {"q/0"} and saved.rows["residual/0"].shape == (2, 8192)
    with pytest.raises(HvdtrainError, match=r"ckpt: its compression state is for 'powersgd', this run "
                                            "uses comm.compression='topk'"):
        state.unpack(entry, "topk", _plan("topk").slots(), "ckpt")
    # a method without state may follow any other
    assert state.unpack(state.pack("qsgd", 3, {}), "topk", _plan("topk").slots(), "x").step == 3
    with pytest.raises(HvdtrainError, match="x: its compression state has a layout"):
        state.unpack([{"step": 3}], "topk", [], "x")  # type: ignore[arg-type]
