"""The compressing exchange's step schedule at 2 ranks (horovodrun --gloo), in both frameworks:
the dense start makes the first ``comm.dense_steps`` steps exactly ``none``'s average (by default
``comm.dense_fraction`` of the run's steps and at least ``comm.dense_min_steps``, which ``hvdtrain
train`` resolves from the run's length it tells the exchange), and the
adaptive switch takes the same decision on both ranks, visible in the bytes sent
(``compress_schedule_worker.py``; the schedule's logic on simulated ranks:
tests/unit/test_compression_schedule.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hvdtrain.compression import make_plan
from hvdtrain.compression.rules import dense_start
from hvdtrain.config import CommConfig
from tests.conftest import horovodrun, read_jsonl
from tests.multirank.compress_schedule_worker import DENSE, INTERVAL, RUNS, SHAPES, STEPS
from tests.multirank.conftest import PYTHON, launch_worker

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


@pytest.mark.long
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.timeout(1200)
def test_a_training_with_a_dense_start_is_none_until_the_method_starts(framework, tmp_path):
    """At the level of a whole run (digits, 2 ranks): with ``comm.dense_steps=5`` top-k's losses
    are ``none``'s through step 6 (step 6's loss is taken before its update) and its wire bytes
    ``none``'s through step 5; then both part (the margin is far wider than rounding)."""
    common = "log.every_steps=1,train.epochs=1"
    launch_worker(2, "gloo", framework, tmp_path, [
        f"none:comm.compression=none,{common}",
        f"topk:comm.compression=topk,comm.dense_steps=5,comm.min_size=0,{common}"])
    none, topk = ({r["step"]: r for r in read_jsonl(tmp_path / name / "metrics.jsonl")
                   if "loss" in r} for name in ("none", "topk"))
    for step in range(1, 7):
        assert topk[step]["loss"] == pytest.approx(none[step]["loss"], rel=1e-5), step
    for step in range(1, 6):
        assert topk[step]["wire_bytes"] == none[step]["wire_bytes"] == none[step]["dense_bytes"]
    later = [step for step in none if step > 6 and step in topk]
    assert all(topk[s]["wire_bytes"] * 10 < none[s]["wire_bytes"] for s in later)
    assert max(abs(topk[s]["loss"] - none[s]["loss"]) / none[s]["loss"] for s in later) > 1e-3


@pytest.mark.parametrize("framework", ["torch", pytest.param("tensorflow", marks=pytest.mark.long)])
@pytest.mark.timeout(900)
def test_topk_alone_runs_dense_for_the_default_dense_start_then_compressed(framework, tmp_path):
    """``comm.compression=topk`` and nothing else (digits, 2 ranks, 75 steps): the default dense
    start, here its floor ``dense_min_steps`` (30, above ``dense_fraction`` x 75 = 3 steps), sends
    ``none``'s bytes (the float32 gradients), every later step top-k's, as ``metrics.jsonl`` logs
    them step by step."""
    steps = 75
    launch_worker(2, "gloo", framework, tmp_path, [
        f"topk:comm.compression=topk,train.max_steps={steps},log.every_steps=1"])
    logged = {r["step"]: r for r in read_jsonl(tmp_path / "topk" / "metrics.jsonl")
              if "wire_bytes" in r}
    default = CommConfig()
    dense = dense_start(-1, default.dense_fraction, default.dense_min_steps, steps)
    assert dense == 30 and sorted(logged) == list(range(1, steps + 1))
    for step, record in logged.items():
        if step <= dense:
            assert record["wire_bytes"] == record["dense_bytes"] > 0, record
        else:
            assert 0 < 10 * record["wire_bytes"] < record["dense_bytes"], record
