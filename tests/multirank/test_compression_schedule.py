"""The compressing exchange's step schedule at 2 ranks (horovodrun --gloo), in both frameworks:
the dense start makes the first ``comm.dense_steps`` steps exactly ``none``'s average, and the
adaptive switch takes the same decision on both ranks, visible in the bytes sent
(``compress_schedule_worker.py``; the schedule's logic on simulated ranks:
tests/unit/test_compression_schedule.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hvdtrain.compression import make_plan
from tests.conftest import horovodrun
from tests.multirank.compress_schedule_worker import DENSE, INTERVAL, RUNS, SHAPES, STEPS
from tests.multirank.conftest import PYTHON

WORKER = str(Path(__file__).with_name("compress_schedule_worker.py"))


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.timeout(900)
def test_dense_start_and_adaptive_switch_at_two_ranks(framework, tmp_path):
    proc = horovodrun(2, "gloo", [PYTHON, WORKER, framework, str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {name: [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]
            for name in RUNS}
    for name, (first, second) in runs.items():
        assert first == second, name  # the same averages, levels and bytes on both ranks
        assert len(first) == STEPS
    for name in ("dense_topk", "dense_powersgd"):
        steps = runs[name][0]
        for s in steps[:DENSE]:  # none's average, none's bytes
            assert s["as_none"] and s["wire"] == s["dense"] > 0, (name, s)
        for s in steps[DENSE:]:  # the method: another average, fewer bytes
            assert not s["as_none"] and 0 < s["wire"] < s["dense"], (name, s)
    for name in ("adaptive_topk", "adaptive_powersgd"):
        steps = runs[name][0]
        # The first two intervals compress less (no previous norm at the first decision), the
        # third follows a steady interval, the fourth the 8x jump of the gradients at step 7.
        low = [True] * (2 * INTERVAL) + [False] * INTERVAL + [True] * INTERVAL
        assert [s["low"] for s in steps] == low, name
        sent = {flag: {s["wire"] for s in steps if s["low"] is flag} for flag in (True, False)}
        assert len(sent[True]) == len(sent[False]) == 1, sent
        plan = make_plan(RUNS[name], 7, SHAPES)
        assert sent[False].pop() == plan.wire_bytes(), name  # the configured ratio or rank
        plan.ratio, plan.rank = min(1.0, 4 * plan.comm.ratio), 4 * plan.comm.rank
        assert sent[True].pop() == plan.wire_bytes(), name  # 4x the ratio or the rank
