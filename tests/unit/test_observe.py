"""Monitoring logic without a launcher: the rank-indexed sums, stragglers, the progress bar, the
stall verdict. The multirank tests run the same code under ``horovodrun``."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdtrain.observe.ranks import Monitor, StepCosts, StragglerDetector
from hvdtrain.observe.records import MetricsLogger, ThrottledSink, throttled
from hvdtrain.observe.sinks import ConsoleSink, scalar_tags
from hvdtrain.observe.system import SystemSampler
from hvdtrain.observe.watchdog import verdict, where


def summed(monitors: list[Monitor], costs: list[StepCosts], steps: int) -> dict[str, float]:
    """What the loop's allreduce makes of every rank's contribution: the sum per key."""
    total: dict[str, float] = {}
    for monitor, cost in zip(monitors, costs, strict=True):
        for key, value in monitor.outgoing(cost, steps).items():
            total[key] = total.get(key, 0.0) + value
    return total


def test_the_window_sum_gives_every_rank_every_ranks_figures():
    warnings: list[str] = []
    monitors = [Monitor(r, 3, r, system=True, straggler_factor=1.5, straggler_logs=2,
                        warn=warnings.append) for r in range(3)]
    costs = []
    for rank in range(3):
        cost = StepCosts()
        for _ in range(4):  # 4 steps; rank 2 computes 3x as long, the others wait for it
            own = 0.03 if rank == 2 else 0.01
            cost.add(0.031, {"data_s": 0.001, "compute_s": own, "comm_s": 0.031 - own,
                             "compress_s": 0.002 * rank,
                             "wire_bytes": 100.0 * (rank + 1), "dense_bytes": 400.0})
        costs.append(cost)
    records = []
    for _ in range(2):  # two logs in a row
        sums = {"loss": 1.0, **summed(monitors, costs, 4)}
        records = [m.incoming(dict(sums), 4, 10) for m in monitors]
    assert records[0] == records[1] == records[2]  # every rank learns the same
    record = records[0]
    assert record["wire_bytes"] == pytest.approx(200.0)  # mean over ranks and steps
    assert record["compression_ratio"] == pytest.approx(2.0)
    assert record["comm_time_s"] == pytest.approx((0.021 * 2 + 0.001) / 3)
    assert record["compress_time_s"] == pytest.approx(0.002)  # (0 + 0.002 + 0.004) / 3
    assert record["slowest_rank"] == 2 and record["step_time_max_s"] == pytest.approx(0.03)
    assert record["step_time_median_s"] == pytest.approx(0.01)
    assert record["straggler_rank"] == 2 and record["straggler_factor"] == pytest.approx(3.0)
    assert record["events"] == [{"event": "straggler", "rank": 2, "factor": pytest.approx(3.0),
                                 "logs": 2}]
    assert len(warnings) == 3 and "rank 2 is a straggler" in warnings[0] and "3.00x" in warnings[0]
    assert {f"rss_mb_rank{r}" for r in range(3)} <= set(record) and record["rss_mb_rank1"] > 10
    assert monitors[0].summary() == {"wire_bytes_total": 2 * 4 * 600.0,
                                     "dense_bytes_total": 2 * 4 * 1200.0, "compression_ratio": 2.0,
                                     "compress_time_s_total": pytest.approx(2 * 4 * 0.006)}
    assert "loss" in sums and not [k for k in record if k.startswith("mon.")]


def test_an_engine_without_step_stats_logs_no_split_and_no_bytes():
    monitor = Monitor(0, 1, 0, system=False, straggler_factor=1.5, straggler_logs=1,
                      warn=lambda m: None)
    cost = StepCosts()
    cost.add(0.02, {})
    record = monitor.incoming(monitor.outgoing(cost, 1), 1, 1)
    assert record == {"step_time_median_s": 0.02, "step_time_max_s": 0.02, "slowest_rank": 0}
    assert monitor.summary() == {}


def test_the_system_sample_reads_this_process_cpu_and_resident_memory():
    # The share of a core this process got depends on the machine's load, so the test compares
    # the sampler with its own bracketing reading of CPU and wall time, not with a fixed share.
    wall0, cpu0 = time.monotonic(), time.process_time()
    sampler = SystemSampler(0)
    while time.process_time() < cpu0 + 0.2:  # busy
        pass
    cpu1 = time.process_time()
    sample = sampler.sample()
    wall1 = time.monotonic()
    low = 100 * (cpu1 - cpu0 - 0.05) / (wall1 - wall0)  # the sampler's window lies inside ours
    assert low < sample["cpu"] <= 100 * (os.cpu_count() or 1)
    status = Path("/proc/self/status").read_text()
    rss_kb = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))
    assert sample["rss"] == pytest.approx(rss_kb / 1024, rel=0.1)
    time.sleep(0.2)  # idle now: the next sample covers only the sleep, a few ms of CPU at most
    assert sampler.sample()["cpu"] < 25


def test_the_process_age_counts_from_the_process_start_not_from_the_import():
    code = ("import time; time.sleep(0.5); from hvdtrain.observe.system import process_age_s; "
            "print(process_age_s())")
    started = time.monotonic()
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True).stdout)
    # The start time is in clock ticks (rounded down), so the age may exceed our bracket by one.
    assert 0.5 <= age < time.monotonic() - started + 1 / os.sysconf("SC_CLK_TCK")


def test_a_straggler_is_reported_once_per_streak_against_the_others_median():
    detector = StragglerDetector(factor=1.5, logs=3)
    # Two ranks: rank 1 at 2x rank 0 (the median of all would be 1.5, hiding it).
    seen = [detector.update([1.0, 2.0]) for _ in range(5)]
    assert [len(s) for s in seen] == [0, 0, 1, 0, 0]
    assert seen[2][0].rank == 1 and seen[2][0].factor == 2.0
    assert detector.update([1.0, 1.0]) == []  # recovered: the streak starts over
    assert [len(detector.update([1.0, 1.4, 1.0])) for _ in range(3)] == [0, 0, 0]  # under 1.5x


def test_pipeline_stages_get_their_compute_wait_and_bubble_and_stragglers_within_a_stage():
    # 2 stages x 2 copies (ranks 0 and 2 hold stage 0, 1 and 3 stage 1), 2 steps of 1 s each.
    # Stage 0 computes 0.25 s (rank 2: 0.75 s, a straggler within its stage), stage 1 0.5 s.
    stages = [0, 1, 0, 1]
    warnings: list[str] = []
    monitors = [Monitor(r, 4, r, system=False, straggler_factor=1.5, straggler_logs=1,
                        warn=warnings.append, stages=stages) for r in range(4)]
    compute = [0.25, 0.5, 0.75, 0.5]
    costs = []
    for rank in range(4):
        cost = StepCosts()
        for _ in range(2):
            cost.add(1.0, {"compute_s": compute[rank], "comm_s": 0.0,
                           "pipe_wait_s": 1.0 - compute[rank], "activation_mb": 10.0 * rank})
        costs.append(cost)
    sums = summed(monitors, costs, 2)
    records = [m.incoming(dict(sums), 2, 2) for m in monitors]
    record = records[0]
    assert records[1] == record
    assert record["stage_compute_s_stage0"] == pytest.approx(0.5)  # (0.25 + 0.75) / 2
    assert record["stage_compute_s_stage1"] == pytest.approx(0.5)
    assert record["stage_wait_s_stage0"] == pytest.approx(0.5)
    assert record["stage_wait_s_stage1"] == pytest.approx(0.5)
    assert record["bubble_fraction"] == pytest.approx((0.75 + 0.5 + 0.25 + 0.5) / 4)
    # Saved activations per step: the largest copy's (ranks 2 and 3: 20 and 30 MiB).
    assert (record["stage_activation_mb_stage0"], record["stage_activation_mb_stage1"]) == (
        20.0, 30.0)
    # Rank 2 is 3x its stage's other copy; against every other rank's median (0.5) only 1.5x.
    assert record["straggler_rank"] == 2 and record["straggler_factor"] == pytest.approx(3.0)
    assert [e["rank"] for e in record["events"]] == [2]
    assert not [k for k in record if k.startswith("mon.")]


def test_each_stage_reports_the_memory_of_its_largest_copy():
    stages = [0, 1, 0, 1]
    monitors = [Monitor(r, 4, r, system=False, straggler_factor=1.5, straggler_logs=1,
                        warn=lambda _: None, stages=stages) for r in range(4)]
    sums = summed(monitors, [StepCosts() for _ in range(4)], 1)
    # What four ranks' system samples add up to (no GPU): rank r holds (r + 1) x 100 MiB.
    sums["mon.gpus"] = 0.0
    for name in ("cpu", "rss", "gpu", "gpu_mem"):
        sums.update({f"mon.{name}.{r}": (r + 1) * 100.0 for r in range(4)})
    record = monitors[0].incoming(sums, 1, 1)
    assert record["rss_mb_rank3"] == 400.0
    assert (record["stage_rss_mb_stage0"], record["stage_rss_mb_stage1"]) == (300.0, 400.0)
    assert not [k for k in record if k.startswith(("stage_gpu", "mon."))]  # no GPU, none left


def test_a_stage_of_one_copy_has_no_one_to_straggle_behind():
    detector = StragglerDetector(factor=1.5, logs=1, groups=[0, 1])
    assert detector.update([1.0, 5.0]) == []  # stage 1 does other work than stage 0


def test_the_progress_bar_redraws_one_line_and_keeps_the_epoch_end():
    out = io.StringIO()
    sink = ConsoleSink(100, out, epochs=2, bar=True)
    sink.log({"step": 25, "epoch": 0, "loss": 0.5, "accuracy": 0.75, "samples_per_sec": 1234.0,
              "time_s": 5.0})
    sink.log({"step": 50, "epoch": 0, "loss": 0.4, "samples_per_sec": 1000.0, "time_s": 10.0,
              "eval_accuracy": 0.9})
    sink.log({"step": 60, "epoch": 1, "loss": 0.3, "time_s": 12.0})
    sink.close()
    lines = out.getvalue().replace("\r", "\r\x00").replace("\n", "\n\x00").split("\x00")
    first, second, third = lines[:3]
    assert first == ("[hvdtrain] epoch 1/2 |######------------------|  25/100 ETA 0:00:15 "
                     "loss=0.5000 accuracy=0.7500 1234 samples/s\r")
    assert second.startswith("[hvdtrain] epoch 1/2 |############") and "eval_accuracy=0.9000" in second
    assert second.endswith("\n") and third.endswith("ETA 0:00:08 loss=0.3000\r")
    assert out.getvalue().endswith("\r\n")  # closing leaves the cursor on a fresh line


def test_the_console_shows_a_language_models_perplexity_where_a_classifier_shows_accuracy():
    out = io.StringIO()
    sink = ConsoleSink(100, out)
    sink.log({"step": 50, "epoch": 0, "loss": 2.0, "perplexity": 7.389, "eval_loss": 2.5,
              "eval_perplexity": 12.18})
    assert out.getvalue() == ("[hvdtrain] epoch 0 step  50/100 loss=2.0000 perplexity=7.3890 "
                              "eval_loss=2.5000 eval_perplexity=12.1800\n")


def test_a_throttled_sink_gets_a_record_per_interval_and_never_misses_evaluations_events_or_the_end():
    out = io.StringIO()
    console = ConsoleSink(100, out)
    sink = ThrottledSink(console, every_s=1.0, total_steps=100)
    times = {10: 0.1, 20: 0.5, 30: 1.2, 40: 1.5, 50: 1.6, 60: 1.7, 70: 1.8, 80: 1.9, 100: 2.0}
    extra = {50: {"eval_accuracy": 0.5}, 70: {"events": [{"event": "straggler", "rank": 1}]},
             80: {"events": []}}
    for step, time_s in times.items():
        sink.log({"step": step, "epoch": 0, "loss": 1.0, "time_s": time_s, **extra.get(step, {})})
    shown = [int(line.split("step")[1].split("/")[0]) for line in out.getvalue().splitlines()]
    # 20 and 40 come under a second after the last line shown; 60 and 80 (no event in its list)
    # under a second after 50's and 70's.
    assert shown == [10, 30, 50, 70, 100]
    assert throttled(console, 0.0, 100) is console  # 0: no throttle at all


def test_warnings_come_from_the_writer_only_and_end_the_bar_line(capsys):
    out = io.StringIO()
    writer = MetricsLogger([ConsoleSink(10, out, bar=True)], writer=True)
    writer.log({"step": 1, "epoch": 0, "loss": 1.0, "time_s": 1.0})
    writer.warn("rank 1 is slow")
    MetricsLogger([], writer=False).warn("not printed")
    assert out.getvalue().endswith("\r\n")
    assert capsys.readouterr().err == "hvdtrain: warning: rank 1 is slow\n"


def test_system_samples_are_tagged_as_system():
    assert scalar_tags({"step": 3, "cpu_percent_rank1": 50.0, "loss": 1.0, "eval_loss": 2.0,
                        "events": [{"rank": 1}]}) == {
        "system/cpu_percent_rank1": 50.0, "train/loss": 1.0, "eval/loss": 2.0}


def test_the_stall_verdict_names_stopped_silent_and_waiting_ranks():
    notes = {0: {"waiting": True, "location": "train_step (e.py:3)", "host": "a", "pid": 10},
             2: {"waiting": False, "location": "forward (m.py:9)", "host": "b", "pid": 12}}
    text = verdict(notes, 3, 30.0)
    assert "Rank 2 (b, pid 12) stopped in forward (m.py:9)." in text
    assert "Rank(s) 1 sent no report" in text and "Rank(s) 0 wait for them in Horovod." in text
    only_waiting = verdict({0: notes[0]}, 1, 30.0)
    assert "a collective that not every rank started" in only_waiting


def test_where_tells_waiting_in_horovod_from_stopped():
    waiting, location = where(sys._getframe())
    assert not waiting and location.startswith("test_where_tells_waiting_in_horovod_from_stopped (")


def test_a_stall_calls_before_exit_then_ends_the_process_with_its_report(tmp_path):
    # In a child: the watchdog ends its process with os._exit.
    code = ("import time; from hvdtrain.rundir import RunDir; "
            "from hvdtrain.observe.watchdog import StallWatchdog\n"
            f"run = RunDir({str(tmp_path)!r})\n"
            "flush = lambda: (run.root / 'flushed').write_text('yes')\n"
            "with StallWatchdog(0.5, run, 0, before_exit=flush):\n"
            "    time.sleep(60)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert (tmp_path / "flushed").read_text() == "yes"
    assert "Rank 0" in (tmp_path / "stall.txt").read_text()
    assert "rank 0 stalled" in proc.stderr
