"""Compression with parameter servers, without MPI nor a framework: the codecs against the
reference math, what they cost on the wire, error feedback on both ends, the server's decode and
sum of compressed pushes, the settings' trip through ``HELLO``, and the config's refusals."""

from __future__ import annotations

import numpy as np
import pytest

from hvdtrain.compression import reference as ref
from hvdtrain.config import load_config
from hvdtrain.ps import protocol
from hvdtrain.ps.codec import WireSettings, encode, pull_scheme, push_scheme
from hvdtrain.ps.layout import ChunkLayout
from hvdtrain.ps.server import Shard

N = 2000


def gradient(seed: int, n: int = N) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("method", ["none", "fp16", "topk", "randomk", "qsgd"])
def test_settings_travel_in_hello_and_come_back_equal(method):
    settings = WireSettings(method, 0.0123456789, method != "qsgd", 256, 100, 2**31 - 1)
    message = protocol.hello(N, 512, 2, 3, "float32", settings=settings.to_ints())
    assert message.dtype == np.int64 and message.size == protocol.HELLO_LENGTH
    assert WireSettings.from_ints(message[8:]) == settings  # the ratio's float64 bits, exactly


@pytest.mark.parametrize(("method", "nbytes"), [
    ("none", 4 * N), ("fp16", 2 * N), ("topk", 8 * 20), ("randomk", 8 * 20),
    ("qsgd", N + 4 * 4)])
def test_a_chunk_costs_what_its_method_promises(method, nbytes):
    """topk and randomk at ratio r: r x n values and as many int32 indices (8 bytes an entry);
    qsgd: a byte an element and a float32 scale per bucket of 512."""
    codec = push_scheme(WireSettings(method, ratio=0.01, bucket=512)).codec(N)
    sent = codec.encode(gradient(0), step=3, chunk=1, rank=0)
    assert sum(b.nbytes for b in sent) == codec.nbytes(N) == nbytes
    assert [(b.size, b.dtype.name) for b in sent] == codec.shapes(N)
    assert [(b.size, b.dtype.name) for b in codec.buffers(N)] == codec.shapes(N)


def test_codecs_decode_to_the_reference():
    x = gradient(1)
    topk = push_scheme(WireSettings("topk", ratio=0.05)).codec(N)
    values, indices = ref.topk_compress(x, ref.num_selected(N, 0.05))
    assert np.array_equal(topk.decode(topk.encode(x, 0, 0, 0), N), ref.scatter(values, indices, N))
    randomk = push_scheme(WireSettings("randomk", ratio=0.05, seed=7)).codec(N)
    sent = randomk.encode(x, 4, 2, 0)
    assert np.array_equal(sent[1], ref.randomk_indices(N, 100, 7, 4, 2))  # every worker draws it
    assert np.array_equal(randomk.encode(x, 4, 2, 1)[1], sent[1])
    qsgd = push_scheme(WireSettings("qsgd", bucket=128, seed=7)).codec(N)
    codes, scales = qsgd.encode(x, 4, 2, 1)
    noise = ref.qsgd_noise(ref.noise_seed(7, 1, 4, 2), N)
    want_codes, want_scales = ref.qsgd_compress(x, 128, noise)
    assert np.array_equal(codes, want_codes) and np.array_equal(scales, want_scales)
    assert not np.array_equal(qsgd.encode(x, 4, 2, 0)[0], codes)  # ranks draw their own noise
    assert np.abs(qsgd.decode([codes, scales], N) - x).max() <= scales.max() / 127 + 1e-6


def test_small_chunks_travel_dense_float32():
    scheme = push_scheme(WireSettings("topk", ratio=0.01, min_size=1024))
    assert scheme.compresses(1024) and not scheme.compresses(1023)
    small = scheme.codec(1023).encode(gradient(2, 1023), 0, 0, 0)
    assert [b.dtype.name for b in small] == ["float32"]
    assert pull_scheme(WireSettings("randomk")).codec(N).shapes(N) == [(20, "float32"),
                                                                        (20, "int32")]


@pytest.mark.parametrize("method", ["topk", "randomk"])
def test_error_feedback_loses_nothing_only_delays_it(method):
    """sent + residual' == grad + residual, step after step: what a push or pull drops waits."""
    codec = push_scheme(WireSettings(method, ratio=0.02)).codec(N)
    residual = np.zeros(N, np.float32)
    total_sent = np.zeros(N, np.float64)
    total_grad = np.zeros(N, np.float64)
    for step in range(5):
        grad = gradient(10 + step)
        before = residual.copy()
        sent = codec.decode(encode(codec, grad, residual, step, 0, 0), N)
        np.testing.assert_allclose(sent + residual, grad + before, rtol=0, atol=1e-6)
        total_sent += sent
        total_grad += grad
    np.testing.assert_allclose(total_sent + residual, total_grad, rtol=0, atol=1e-5)
    assert np.count_nonzero(residual) > N // 2  # most entries still wait


def shard_for(method: str, workers: int = 3, feedback: bool = True) -> tuple[Shard, ChunkLayout]:
    layout = ChunkLayout(5 * 512, 512, 2)
    settings = WireSettings(method, ratio=0.05, error_feedback=feedback, bucket=128,
                            min_size=256, seed=3)
    return Shard(layout, 0, workers, settings), layout


def push(shard: Shard, step: int, workers: int) -> list[np.ndarray]:
    """Every worker's compressed push into the shard's receive buffers; their decoded chunks."""
    decoded = []
    for i, n in enumerate(shard.sizes):
        chunks = []
        for w in range(workers):
            sent = shard.pushes[i].encode(gradient(100 * step + 10 * i + w, n), step,
                                          shard.chunks[i], w)
            for buffer, message in zip(shard.received[w][i], sent, strict=True):
                buffer[:] = message  # as MPI's receive would
            chunks.append(shard.pushes[i].decode(sent, n))
        decoded.append(chunks)
    return decoded


@pytest.mark.parametrize("method", ["topk", "randomk", "qsgd"])
def test_the_server_decodes_and_sums_compressed_pushes_in_worker_order(method):
    shard, _ = shard_for(method)
    decoded = push(shard, 0, 3)
    for i, chunks in enumerate(decoded):
        shard.add(i)
        assert np.array_equal(shard.sums[i], (chunks[0] + chunks[1]) + chunks[2])
        assert np.count_nonzero(chunks[0]) < shard.sizes[i] or method == "qsgd"


def test_the_server_keeps_what_its_top_k_pull_did_not_send():
    """Over steps, the pulls plus the server's residual are the sums of the pushes: the server
    owes the rest, it does not drop it; its residual travels with the shard (``STATE``)."""
    shard, _ = shard_for("topk")
    pulled = [np.zeros(n, np.float64) for n in shard.sizes]
    summed = [np.zeros(n, np.float64) for n in shard.sizes]
    for step in range(3):
        push(shard, step, 3)
        for i, n in enumerate(shard.sizes):
            shard.add(i)
            summed[i] += shard.sums[i]
            sent = shard.answer(i, step, 9)
            assert [(b.size, b.dtype.name) for b in sent] == shard.pulls[i].shapes(n)
            pulled[i] += shard.pulls[i].decode(sent, n)
    for i in range(len(shard.sizes)):
        np.testing.assert_allclose(pulled[i] + shard.residuals[i], summed[i], rtol=0, atol=1e-4)
    assert shard.residual is not None and np.count_nonzero(shard.residual) > 0
    assert all(np.shares_memory(r, shard.residual) for r in shard.residuals)


def test_without_error_feedback_the_server_keeps_nothing():
    shard, _ = shard_for("topk", feedback=False)
    assert shard.residual is None and shard.residuals == [None] * len(shard.sizes)
    shard, _ = shard_for("qsgd")  # unbiased: no residuals, as on the ring
    assert shard.residual is None
    shard, _ = shard_for("randomk")  # its pull is exact (next test)
    assert shard.residual is None


def test_the_random_k_pull_sends_the_whole_sum():
    """Every worker pushed the same draw of indices, so the sum is nonzero there only, and the
    pull at that draw (unscaled) decodes to the very sum: nothing for the server to keep."""
    shard, _ = shard_for("randomk", feedback=False)  # pushes scaled by n / k, the pull is not
    push(shard, 2, 3)
    for i, n in enumerate(shard.sizes):
        shard.add(i)
        sent = shard.answer(i, 2, 3)
        assert np.array_equal(shard.pulls[i].decode(sent, n), shard.sums[i])
        assert sum(b.nbytes for b in sent) == 8 * ref.num_selected(n, 0.05) < 4 * n


@pytest.mark.parametrize("method", ["topk", "randomk", "qsgd"])
def test_dedicated_bsp_servers_take_the_method(method):
    cfg = load_config(None, ["comm.topology=ps", f"comm.compression={method}"], environ={})
    assert cfg.comm.compression == method
