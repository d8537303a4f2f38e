"""The language model at two ranks (Gloo): it trains, and -np 2 with batch b equals -np 1 with
batch 2b."""

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


def launch(np_: int, out, runs: list[str]) -> Launch:
    proc = horovodrun(np_, "gloo", [PYTHON, WORKER, str(out), str(LM_CONFIGS["torch"]), *runs],
                      timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Launch("torch", "gloo", out)


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
