"""The language model at two ranks (Gloo): it trains (TensorFlow too, dense and compressed), and
-np 2 with batch b equals -np 1 with batch 2b; at four ranks in 2 stages x 2 copies it trains
with every compression method (`long`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.conftest import horovodrun
from tests.multirank.conftest import PYTHON, WORKER, Launch
from tests.text_data import LM_CONFIGS, docs_corpus

# SGD without warm-up: the same effective rate at both sizes (0.05 scaled x2, against 0.1), and
# nothing that divides by the gradients' size, as Adam does, to magnify rounding.
EQUIV = ("data.batch_size={b},optim.name=sgd,optim.lr={lr},optim.momentum=0.9,"
         "optim.warmup_steps=0,train.max_steps=12")


def launch(np_: int, out, runs: list[str], framework: str = "torch") -> Launch:
    proc = horovodrun(np_, "gloo", [PYTHON, WORKER, str(out), str(LM_CONFIGS[framework]), *runs],
                      timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Launch(framework, "gloo", out)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    corpus = docs_corpus(tmp_path_factory.mktemp("text") / "docs")
    root = f"data.options.root={corpus}"
    two = launch(2, tmp_path_factory.mktemp("lm-np2"),
                 [f"base:{root},train.max_steps=100",
                  f"equiv:{root}," + EQUIV.format(b=8, lr=0.05)])
    one = launch(1, tmp_path_factory.mktemp("lm-np1"),
                 [f"one:{root}," + EQUIV.format(b=16, lr=0.1)])
    return two, one


def test_two_ranks_train_the_lm_and_log_its_perplexity(launches):
    two, _ = launches
    summary = two.summary("base")
    assert summary["world_size"] == 2 and summary["steps"] == 100
    final = summary["final"]
    assert final["eval_perplexity"] == pytest.approx(math.exp(final["eval_loss"]))
    assert final["eval_perplexity"] < 30  # from 256, a uniform guess
    (p0, r0), (p1, r1) = two.rank("base", 0), two.rank("base", 1)
    for key in p0:
        assert np.array_equal(p0[key], p1[key]), key
    # The evaluation is the average over both ranks' windows of the validation split.
    count = r0["local_eval"]["count"] + r1["local_eval"]["count"]
    loss = (r0["local_eval"]["loss"] + r1["local_eval"]["loss"]) / count
    assert final["eval_loss"] == pytest.approx(loss)


def test_two_ranks_match_one_rank_with_twice_the_batch(launches):
    """The same global batches and mean gradients: the parameters agree to float32 rounding
    compounded over 12 steps, where a wrongly weighted batch or one step more moves them by far
    more than 1e-5."""
    two, one = launches
    params, _ = two.rank("equiv", 0)
    reference, _ = one.rank("one", 0)
    assert params.keys() == reference.keys() and len(params) == 2 + 12 * 2 + 3
    for key in params:
        np.testing.assert_allclose(params[key], reference[key], atol=1e-5, rtol=0, err_msg=key)


def test_tensorflow_two_ranks_train_the_lm_with_dense_and_compressed_exchanges(tmp_path_factory):
    """The embeddings' gradients, IndexedSlices in TensorFlow, go through the dense exchange and a
    compressing one (both failed on them before they were made dense) and keep the copies equal."""
    corpus = docs_corpus(tmp_path_factory.mktemp("text-tf") / "docs")
    methods = ("none", "qsgd")
    launched = launch(2, tmp_path_factory.mktemp("lm-tf-np2"),
                      [f"{m}:data.options.root={corpus},train.max_steps=20,comm.compression={m}"
                       + ("" if m == "none" else ONE_DENSE) for m in methods], "tensorflow")
    for method in methods:
        summary = launched.summary(method)
        assert summary["world_size"] == 2 and summary["steps"] == 20
        assert summary["final"]["eval_perplexity"] < 60, summary["final"]  # seen 29, from 256
        (p0, _), (p1, _) = launched.rank(method, 0), launched.rank(method, 1)
        assert p0.keys() == p1.keys() and p0
        for key in p0:
            assert np.array_equal(p0[key], p1[key]), key


# Every method at the LM's defaults (Adam), in 2 stages x 2 copies: the exchange runs within each
# stage's process set, the stages' split runs through the transformer blocks.
STAGED = ("pipeline.stages=2,pipeline.microbatches=2,data.batch_size=8,train.max_steps=30,"
          "optim.warmup_steps=5")
ONE_DENSE = ",comm.dense_steps=1"
"""One dense step, then the method: the default dense start, at least ``comm.dense_min_steps``
(30), would average every step of these short runs dense."""
METHODS = {"fp16": "", "topk": ",comm.min_size=256,comm.ratio=0.1" + ONE_DENSE,
           "randomk": ",comm.min_size=256,comm.ratio=0.1" + ONE_DENSE,
           "qsgd": ",comm.min_size=256" + ONE_DENSE, "powersgd": ",comm.min_size=256" + ONE_DENSE}
"""Each method and its parameters (a key the method does not read is refused)."""


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """Per framework, on first use: one -np 4 launch training every method in turn."""
    cache: dict[str, Launch] = {}

    def get(framework: str) -> Launch:
        if framework not in cache:
            corpus = docs_corpus(tmp_path_factory.mktemp(f"text-{framework}") / "docs")
            cache[framework] = launch(
                4, tmp_path_factory.mktemp(f"lm-staged-{framework}"),
                [f"{m}:data.options.root={corpus},{STAGED},comm.compression={m}{params}"
                 for m, params in METHODS.items()], framework)
        return cache[framework]

    return get


# Both launches are `long` (make test-long). What still covers them in make test: every method
# in PyTorch's stages in test_pipeline_compression.py, TensorFlow's stages with compression in
# test_pipeline_tf_compression.py and test_pipeline_tf.py (qsgd under MPI), and the GPT in
# pipeline stages in tests/slurm/test_memory_limit.py and (Hugging Face's) test_hf_shard.py.
@pytest.mark.long
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.parametrize("method", METHODS)
def test_the_lm_trains_in_stages_with_every_compression_method(staged, framework, method):
    launched = staged(framework)
    summary = launched.summary(method)
    assert summary["pipeline"] == "2 stages x 2 copies" and summary["steps"] == 30
    # From 256 (a uniform guess): seen 28-36 with fp16, qsgd, powersgd and top-k at 10%, 80 with
    # random-k at 10% (its residuals are still being paid out after 30 steps).
    assert summary["final"]["eval_perplexity"] < 160, summary["final"]
    for first, second in ((0, 2), (1, 3)):  # each stage's copies hold the same parameters
        a, b = launched.rank(method, first)[0], launched.rank(method, second)[0]
        assert a.keys() == b.keys() and a
        for key in a:
            assert np.array_equal(a[key], b[key]), key
