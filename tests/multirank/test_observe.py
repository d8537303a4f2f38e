"""Monitoring under ``horovodrun -np 2``: every sink read back with its own reader, the new keys,
a straggler named, a stalled rank reported, and ``hvdtrain report`` over a run of each framework.

One launch per framework holds all the sinks (W&B offline with a key in the environment); the
PyTorch one slows rank 1 on purpose. A third launch hangs rank 1.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, CONFIG, TF_CONFIG, horovodrun, hvdtrain_cli, read_jsonl
from tests.torch.test_sinks import FAKE_KEY, event_accumulator, wandb_contents

COMMON = ("log.every_steps=5", "log.wandb=offline", "log.tensorboard=true", "log.console=true",
          "log.progress=lines", "log.console_every_s=0", "log.dashboard_every_s=0", "log.straggler_steps=3",
          "checkpoint.every_steps=0")
RUNS = {
    # Rank 1 sleeps 50 ms per batch: several times its own compute, so it must be named.
    "torch": (CONFIG, ("train.epochs=3", "model.name=tests.torch.user_models:SlowOnRank",
                       "model.options={rank: 1, delay: 0.05}")),
    "tensorflow": (TF_CONFIG, ("train.epochs=2",)),
}


class Launch:
    """One monitored run: its directory, records and the launcher's output."""

    def __init__(self, run_dir: Path, output: str) -> None:
        self.run_dir, self.output = run_dir, output
        self.records = read_jsonl(run_dir / "metrics.jsonl")
        self.summary = json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def monitored(tmp_path_factory):
    """``monitored(framework)``: the framework's run with every sink on, launched on first use."""
    cache: dict[str, Launch] = {}

    def get(framework: str) -> Launch:
        if framework not in cache:
            config, extra = RUNS[framework]
            run_dir = tmp_path_factory.mktemp(f"monitor-{framework}") / "run"
            with pytest.MonkeyPatch.context() as env:
                env.setenv("WANDB_API_KEY", FAKE_KEY)  # offline: W&B must not use or keep it
                proc = horovodrun(2, "gloo", [str(BIN / "hvdtrain"), "train", str(config),
                                              f"log.dir={run_dir}", *COMMON, *extra], timeout=600)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            cache[framework] = Launch(run_dir, proc.stdout + proc.stderr)
        return cache[framework]

    return get


@pytest.mark.timeout(900)
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_every_sink_holds_the_metrics_and_only_rank_0_writes(monitored, framework):
    run = monitored(framework)
    records, steps = run.records, [r["step"] for r in run.records]
    assert len(records) >= 8 and steps == sorted(set(steps))
    # TensorBoard, through its own event reader: one file (rank 0's), every logged value.
    assert len(list((run.run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    events = event_accumulator(run.run_dir / "tensorboard")
    for tag, key in (("train/loss", "loss"), ("train/comm_time_s", "comm_time_s"),
                     ("train/wire_bytes", "wire_bytes"), ("system/rss_mb_rank1", "rss_mb_rank1"),
                     ("eval/accuracy", "eval_accuracy")):
        logged = [(r["step"], r[key]) for r in records if key in r]
        scalars = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in scalars] == [s for s, _ in logged] and len(logged) >= 2, tag
        assert [v for _, v in scalars] == pytest.approx([v for _, v in logged], rel=1e-6)
    # W&B, through its offline run files: one run, the history, the system metrics, the summary.
    assert len(list(run.run_dir.glob("wandb/offline-run-*"))) == 1
    _, config, history, summary = wandb_contents(run.run_dir)
    assert config["framework"] == framework and sorted(history) == steps
    for record in records:
        row = history[record["step"]]
        assert row["train/loss"] == pytest.approx(record["loss"])
        assert row["system/cpu_percent_rank1"] == pytest.approx(record["cpu_percent_rank1"])
    assert summary["wire_bytes_total"] == pytest.approx(run.summary["wire_bytes_total"])
    # The console: rank 0 prints one line per record; rank 1 prints none.
    lines = re.findall(r"^\[(\d)\]<stdout>:\[hvdtrain\] epoch \d+ step +(\d+)/", run.output, re.M)
    assert lines == [("0", str(s)) for s in steps]
    # The API key was in every rank's environment; no file of the run holds it.
    files = [p for p in run.run_dir.rglob("*") if p.is_file()]
    assert len(files) > 5 and [p for p in files if FAKE_KEY.encode() in p.read_bytes()] == []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_time_split_bytes_and_system_are_logged(monitored, framework):
    run = monitored(framework)
    for record in run.records:
        assert record["comm_time_s"] > 0 and record["compute_time_s"] > 0
        assert record["data_wait_time_s"] >= 0
        # No compression: what goes on the wire is the dense fp32 gradient, the same every step.
        assert record["wire_bytes"] == record["dense_bytes"] == run.records[0]["wire_bytes"] > 1000
        assert record["compression_ratio"] == 1.0
        assert record["step_time_max_s"] >= record["step_time_median_s"] > 0
        assert record["slowest_rank"] in (0, 1)
        for rank in (0, 1):
            assert record[f"cpu_percent_rank{rank}"] >= 0 and record[f"rss_mb_rank{rank}"] > 50
        assert not any(key.startswith("gpu_") for key in record)  # no GPU here: no GPU keys
    steps, per_step = run.summary["steps"], run.records[0]["wire_bytes"]
    assert run.summary["wire_bytes_total"] == pytest.approx(per_step * steps * 2)  # 2 ranks
    assert run.summary["dense_bytes_total"] == run.summary["wire_bytes_total"]
    assert run.summary["compression_ratio"] == 1.0


@pytest.mark.timeout(900)
def test_a_slowed_rank_is_named_as_the_straggler(monitored):
    run = monitored("torch")
    events = [e for r in run.records for e in r.get("events", [])]
    assert all(e["event"] == "straggler" and e["factor"] > 1.5 for e in events)
    # On a busy shared machine rank 0 may lag for a while too; rank 1 must lead by far.
    named = [e["rank"] for e in events]
    assert named.count(1) >= 1 and named.count(1) > 2 * named.count(0), events
    slow = [r for r in run.records if r["step"] > 5]  # from the second log on
    assert sum(r["slowest_rank"] == 1 for r in slow) >= 0.8 * len(slow)
    warned = re.findall(r"^\[(\d)\]<stderr>:hvdtrain: warning: rank (\d) is a straggler: its step "
                        r"time was ([\d.]+)x the median", run.output, re.M)
    assert sorted(rank for _, rank, _ in warned) == sorted(map(str, named))
    assert {who for who, _, _ in warned} == {"0"}  # rank 1 learns it too, but only rank 0 warns
    tagged = event_accumulator(run.run_dir / "tensorboard").Scalars("train/straggler_rank")
    assert 1.0 in [e.value for e in tagged]


@pytest.mark.timeout(900)
def test_report_overlays_the_two_frameworks(monitored, tmp_path):
    torch_run, tf_run = monitored("torch"), monitored("tensorflow")
    proc = hvdtrain_cli("report", str(torch_run.run_dir), str(tf_run.run_dir), "--out",
                        str(tmp_path / "report"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    pngs = {p.name for p in (tmp_path / "report").glob("*.png")}
    assert pngs == {"loss.png", "accuracy.png", "throughput.png", "step_time.png",
                    "eval_accuracy.png", "comm_compute.png", "bytes.png", "system.png"}
    assert all((tmp_path / "report" / name).stat().st_size > 10_000 for name in pngs)
    rows = [line.split("|")[1:-1] for line in (tmp_path / "report" / "report.md").read_text()
            .splitlines() if line.startswith("| digits")]
    assert [[c.strip() for c in row][:4] for row in rows] == [
        ["digits_torch", "torch", "none", "2"], ["digits_tf", "tensorflow", "none", "2"]]
    assert "1" in rows[0][-1].strip().split(", ")  # the torch run's straggler


@pytest.mark.timeout(600)
def test_a_stalled_rank_is_named_and_the_job_fails_in_time_with_stacks(tmp_path):
    timeout = 10
    started = time.monotonic()
    proc = horovodrun(2, "gloo", [str(BIN / "hvdtrain"), "train", str(CONFIG),
                                  "model.name=tests.torch.user_models:HangOnRank",
                                  "model.options={rank: 1, after: 5}",
                                  f"train.stall_timeout_s={timeout}", "log.wandb=disabled",
                                  "log.every_steps=1", "log.jsonl_every_s=3600",
                                  f"log.dir={tmp_path}"], timeout=300)
    elapsed = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    # Start-up (imports, hvd.init) plus the timeout, the note-gathering grace and a margin; the
    # injected hang lasts an hour.
    assert elapsed < 120 + timeout + 5 + 30, output[-3000:]
    verdict = (tmp_path / "stall.txt").read_text()
    assert re.search(r"Rank 1 \(.+, pid \d+\) stopped in loss_and_metrics \(.*user_models\.py:\d+\)",
                     verdict), verdict
    assert "Rank(s) 0 wait for them in Horovod." in verdict and "Rank 0 (" not in verdict
    assert re.search(r"^\[0\]<stderr>:hvdtrain: error: stall: no step or evaluation finished for "
                     r"10 s .*Rank 1 ", output, re.M), output[-3000:]
    notes = {r: json.loads((tmp_path / f"stall-rank{r}.json").read_text()) for r in (0, 1)}
    assert notes[0]["waiting"] and not notes[1]["waiting"]
    # In the gradient exchange: Horovod's synchronize, called by the dense exchange's run.
    assert "hvdtrain/torch/exchange.py" in notes[0]["location"]
    stacks = {r: (tmp_path / f"stacks-rank{r}.txt").read_text() for r in (0, 1)}
    assert stacks[1].startswith("hvdtrain: rank 1 (pid ") and "within 10 s" in stacks[1]
    assert "in loss_and_metrics" in stacks[1] and "in train_step" in stacks[1]
    assert "horovod" in stacks[0] and "in train_step" in stacks[0]
    # Rank 0 held every record (log.jsonl_every_s=3600) and wrote them out at the stall: those of
    # steps 1 to 4 (step 5's sum is read after step 6, which never ends).
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
