"""benchmarks/compression_convergence.py's GPT parts: the generated corpus and the perplexity report."""

from __future__ import annotations

import sys

from tests.conftest import ROOT

sys.path[:0] = [str(ROOT / "benchmarks")]
import compression_convergence as cc  # noqa: E402


def test_the_generated_corpus_is_fixed_by_its_seed_and_sized():
    text = cc.sentence_text()
    assert text == cc.sentence_text()
    assert len(text) == cc.CORPUS_BYTES
    assert cc.sentence_text(seed=1, size=5000) != text[:5000]
    words = {w.strip(".").lower() for w in text.split()}
    assert len(words) <= cc.WORDS


def test_steps_to_a_perplexity_counts_the_first_evaluation_at_or_below_it():
    points = [(10, 9.0), (20, 5.02), (30, 4.9)]
    assert cc.steps_to(points, 5.0, lower_better=True) == 20  # within SLACK (0.5%) of it
    assert cc.steps_to(points, 4.0, lower_better=True) is None
    assert cc.steps_to([(10, 0.5), (20, 0.9)], 0.9) == 20


def test_the_gpt_report_gives_the_perplexity_increase_and_the_flat_spread():
    def rec(ppl: float, curve: list[float]) -> dict:
        return {"perplexity": ppl, "ratio": 12.0, "step_ms": 100.0, "wire_per_step": 1000.0,
                "curve": [(56 * (i + 1), c) for i, c in enumerate(curve)]}

    data = {"names": ["none", "topk"], "dataset": "lm", "framework": "torch", "hook": {},
            "hvdtrain": {s: {"none": rec(2.0, [3.0, 2.02, 2.0]),
                             "topk": rec(2.0 * (1.01 + 0.01 * s), [3.0, 2.1, 2.0 * (1.01 + 0.01 * s)])}
                         for s in (0, 1)}}
    text = cc.report(data, flat_epochs=2)
    topk = next(line for line in text.splitlines() if "`topk`" in line)
    assert "| 2 | 2.03 | +1.50 (" in topk  # mean perplexity, mean increase over none in percent
    assert "12.0x | none reach it" in topk
    assert "moves at most 1.00% (per seed: 1.00, 1.00)" in text


def test_the_gpt_report_pairs_torchs_hook_by_perplexity():
    def rec(ppl: float) -> dict:
        return {"perplexity": ppl, "ratio": 12.0, "step_ms": 100.0, "wire_per_step": 1000.0,
                "curve": [(56, 3.0), (112, ppl)]}

    data = {"names": ["none", "powersgd"], "dataset": "lm", "framework": "torch",
            "hvdtrain": {s: {"none": rec(2.0), "powersgd": rec(2.04)} for s in (0, 1)},
            "hook": {s: {"ddp": {"perplexity": 2.0 * (1 + 0.01 * s)},
                         "hook120": {"perplexity": 2.2}} for s in (0, 1)}}
    text = cc.report(data, flat_epochs=2)
    hook = next(line for line in text.splitlines() if "powerSGD_hook, start 120 |" in line)
    assert "| 2 | 2.20 | +9.46 (" in hook  # 2.2 / 2.0 - 1 and 2.2 / 2.02 - 1, in percent
    paired = next(line for line in text.splitlines() if line.startswith("- hvdtrain `powersgd`"))
    # hvdtrain's perplexity over the hook's, by seed: 2.04 / 2.2 - 1 = -7.27%
    assert "perplexity over torch's powerSGD_hook start 120, by seed: -7.27 (" in paired
    assert "(per seed: -7.3, -7.3)" in paired
    assert "torch DDP against hvdtrain `none`, same seeds: +0.50 (" in text
