"""The benchmark harness's statistics, parsing, grouping, verdicts and clock on canned inputs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402
import monitoring  # noqa: E402
import overhead  # noqa: E402
import workload  # noqa: E402


def test_summarize_gives_min_median_max_and_ratio_to_baseline():
    rows = harness.summarize({"A": [3.0, 1.0, 2.0], "B": [4.0, 2.0, 6.0, 5.0]}, baseline="A")
    assert [(r.name, r.runs, r.min, r.median, r.max) for r in rows] == [
        ("A", 3, 1.0, 2.0, 3.0), ("B", 4, 2.0, 4.5, 6.0)]
    assert [r.ratio for r in rows] == [1.0, 2.25]


@pytest.mark.parametrize("samples, message", [
    ({"A": [1.0]}, "baseline 'X' is not among"), ({"X": [1.0], "B": []}, "no samples for: B"),
    ({"X": [0.0]}, "non-positive median")])
def test_summarize_rejects_bad_input(samples, message):
    with pytest.raises(ValueError, match=message):
        harness.summarize(samples, baseline="X")


def test_markdown_table_and_section(tmp_path):
    rows = harness.summarize({"A": [0.010, 0.012], "B": [0.0111]}, baseline="A")
    table = harness.markdown_table(rows)
    assert table.splitlines()[2] == "| A | 2 | 10.000 | 11.000 | 12.000 | 1.000 |"
    assert table.splitlines()[3] == "| B | 1 | 11.100 | 11.100 | 11.100 | 1.009 |"
    section = harness.markdown_section("T", "python x.py --flag", {"cores": 2}, rows, ["a note"],
                                       date="2026-01-01")
    doc = tmp_path / "docs" / "b.md"
    harness.put_section(doc, section, "# Head\n")
    other = section.replace("## T", "## U").replace("a note", "another note")
    harness.put_section(doc, other, "# Head\n")
    harness.put_section(doc, section.replace("a note", "a newer note"), "# Head\n")
    text = doc.read_text()
    # A rerun replaces its own section in place and leaves the others alone.
    assert text.startswith("# Head\n\n## T\n") and text.count("python x.py --flag") == 2
    assert "- a newer note" in text and "- a note" not in text and "- another note" in text
    assert text.index("## T") < text.index("## U") and "Machine: cores: 2." in text


def test_parse_measurements_reads_every_tagged_line_of_one_job_in_order():
    out = ("[1]<stdout>:noise\n"
           "[0]<stdout>:{\"round\": -1, \"step_time_s\": 0.5}\n"
           "[0]<stdout>:{\"round\": 0, \"step_time_s\": 0.25}[1,0]<stdout>:\n"
           "{\"other\": 1}\n[0]<stdout>:{broken\n"
           "[1,0]<stdout>:{\"round\": 1, \"step_time_s\": 0.75}\n")
    assert harness.parse_measurements(out, "step_time_s") == [
        {"round": -1, "step_time_s": 0.5}, {"round": 0, "step_time_s": 0.25},
        {"round": 1, "step_time_s": 0.75}]
    assert harness.parse_measurements(out, "missing") == []


def test_round_order_alternates():
    assert harness.round_order(["A", "B", "C"], 0) == ["A", "B", "C"]
    assert harness.round_order(["A", "B", "C"], 1) == ["C", "B", "A"]
    # The warm-up round (-1) runs in the reversed order, so measured round 0 does not repeat it.
    assert harness.round_order(["A", "B", "C"], -1) == ["C", "B", "A"]


def _records(rounds, slots, warmup=1):
    return [{"round": r, "slot": s, "t": 10 * r + s}
            for r in range(-warmup, rounds) for s in harness.round_order(range(slots), r)]


def test_group_runs_maps_slots_to_names_and_drops_warm_up():
    results = harness.group_runs(_records(2, 3), ["A", "B", "A'"], rounds=2)
    assert list(results) == ["A", "B", "A'"]
    assert harness.samples_of(results, "t") == {"A": [0.0, 10.0], "B": [1.0, 11.0],
                                                "A'": [2.0, 12.0]}


def test_group_runs_rejects_a_short_job_and_duplicate_names():
    with pytest.raises(harness.BenchError, match=r"expected 3 measured runs .*A \(2\)"):
        harness.group_runs(_records(2, 3), ["A", "B", "A'"], rounds=3)
    with pytest.raises(ValueError, match="must be unique"):
        harness.group_runs(_records(1, 2), ["A", "A"], rounds=1)


def _rows(candidate, control):
    return harness.summarize({overhead.BASELINE: [1.0], overhead.CANDIDATE: [candidate],
                              overhead.CONTROL: [control]}, baseline=overhead.BASELINE)


@pytest.mark.parametrize("candidate, control, expected", [
    (1.02, 1.005, "target (ratio <= 1.03 with A/A within 1%) met"),
    (1.05, 0.995, "target (ratio <= 1.03 with A/A within 1%) missed"),
    (1.00, 1.02, "inconclusive, the A/A control is off by more than 1%"),
    (1.00, 0.98, "inconclusive")])
def test_overhead_verdict(candidate, control, expected):
    text = overhead.verdict(_rows(candidate, control))
    head = f"hvdtrain / hand-written = {candidate:.3f}, A/A control = {control:.3f}"
    assert text.startswith(head)
    assert expected in text


def test_clock_steady_span_starts_at_epoch_two_and_ends_at_evaluation(monkeypatch):
    now = iter([0.0, 1.0, 3.0, 6.0, 10.0, 15.0, 21.0])
    monkeypatch.setattr(workload.time, "perf_counter", lambda: next(now))
    clock = workload.Clock()
    for _ in range(4):  # two epochs of two steps
        clock.step()
    clock.evaluation()
    clock.evaluation()  # a later evaluation does not move the end
    assert clock.steady_seconds(2) == 10.0 - 3.0  # step 3 (epoch 2) to the evaluation
    assert clock.steady_seconds(1) is None
    record = workload.measurement(0, 4, 14.0, 0.5, 0.9, clock=clock, epochs=2, extra=1)
    assert record["step_time_s"] == 3.5 and record["steady_step_time_s"] == 3.5
    assert record["rank"] == 0 and record["extra"] == 1


def test_block_means_average_each_block_class_over_an_odd_number_of_steady_blocks():
    clock = workload.Clock()
    start = 0.0
    for i in range(650):  # five epochs of 130 steps; odd blocks of 50 steps take 0.5 ms more a step
        clock.step_starts.append(start)
        start += 0.001 + (0.0005 if (i // 50) % 2 else 0.0) + (0.1 if i < 50 else 0.0)
    clock.eval_start = start
    # The steady state starts at step 130: blocks 3 to 11 count (nine, an odd number), not the
    # slow block 0 (epoch 1), block 2 (partly in epoch 1), nor block 12 (the tenth).
    means = clock.block_means(5, 50, 4)  # by class: block number mod 4
    assert means == pytest.approx([0.001, 0.0015, 0.001, 0.0015])
    assert clock.block_means(5, 50, 16) is None  # fewer blocks than classes
    assert clock.block_means(1, 50, 4) is None


def test_block_means_let_no_drift_along_the_run_favour_odd_or_even_blocks():
    clock, start = workload.Clock(), 0.0
    for i in range(920):  # 40 epochs of 23 steps, every step a little slower than the last
        clock.step_starts.append(start)
        start += 0.004 * (1 + 0.1 * i / 920)
    clock.eval_start = start
    means = clock.block_means(40, 50, 4)
    assert monitoring.live_over_muted([means]) == pytest.approx(1.0, abs=1e-9)


def test_within_run_pools_the_blocks_of_every_run_and_controls_with_the_muted_ones():
    ratio, low, high, aa = monitoring.within_run([[1.0, 1.01, 1.0, 1.01]] * 6)
    assert (ratio, low, high, aa) == pytest.approx((1.01, 1.01, 1.01, 1.0))
    runs = [[1.0 + 0.01 * (i % 3), 1.02 + 0.01 * (i % 4), 1.0 + 0.01 * (i % 5), 1.02] for i in range(20)]
    ratio, low, high, aa = monitoring.within_run(runs)
    assert low < ratio < high and 1.0 < ratio < 1.03 and aa == pytest.approx(1.01 / 1.02, abs=0.002)
    assert monitoring.within_run(runs) == (ratio, low, high, aa)  # seeded: the same every time


def test_within_verdict_needs_the_whole_interval_under_target_and_a_steady_control():
    assert monitoring.within_verdict(1.010, 1.019, 0.995).endswith(") met")
    assert monitoring.within_verdict(1.010, 1.021, 0.995).endswith(") not shown")
    assert "inconclusive" in monitoring.within_verdict(1.000, 1.005, 0.985)


def test_alternation_mutes_records_and_system_samples_in_every_other_block_of_epochs():
    import hvdtrain_worker

    from hvdtrain.loop import Loop
    from hvdtrain.observe.records import MetricsLogger, Sink
    from hvdtrain.observe.system import SystemSampler

    class Collect(Sink):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def log(self, record: dict) -> None:
            self.steps.append(record["step"])

    sink, sampler = Collect(), SystemSampler(0)
    logger, originals = MetricsLogger([sink]), (MetricsLogger.log, Loop._end_epoch)
    samples, alternation = [], hvdtrain_worker.Alternation()
    with alternation.active():
        assert Loop._end_epoch is not originals[1]  # counts the loop's epochs
        for step in range(1, 201):  # epochs of 25 steps, blocks of 2: 1-50 muted, 51-100 live, ...
            if step % 10 == 0:
                logger.log({"step": step})
                samples.append(sampler.sample())
            if step % 25 == 0:
                alternation.epoch_ended()
    assert sink.steps == [60, 70, 80, 90, 100, 160, 170, 180, 190, 200]
    # Muted blocks repeat the last reading (the allreduce keeps its keys); live ones read anew.
    assert samples[1] is samples[0] and samples[5] is not samples[4] and samples[11] is samples[10]
    assert (MetricsLogger.log, Loop._end_epoch) == originals  # restored after the block
    logger.log({"step": 0})
    assert sink.steps[-1] == 0


def test_clock_without_evaluation_has_no_steady_span():
    clock = workload.Clock()
    clock.step()
    clock.step()
    assert clock.steady_seconds(2) is None


def test_report_prints_rank_zero_only(capsys):
    workload.report({"rank": 1, "steps": 3})
    workload.report({"rank": 0, "steps": 3})
    out = capsys.readouterr().out
    assert harness.parse_measurements(out, "steps") == [{"rank": 0, "steps": 3}]
    assert json.loads(out) == {"rank": 0, "steps": 3}


def test_bench_drivers_import_no_framework():
    # In a process of its own: the full suite's process holds the frameworks for the other tiers.
    # interleaved imports a variant's worker only when the job runs it.
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import frameworks, interleaved, overhead\n"
            "assert not {'torch', 'tensorflow', 'horovod'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code, str(BENCH)], check=True)


def test_machine_record_names_cores_and_versions():
    record = harness.machine_record()
    assert record["cores"] >= 1 and record["torch"].startswith("2.13.0")


def test_bench_new_drivers_import_no_framework():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import allreduce, fusion, ddp, scaling\n"
            "assert not {'torch', 'tensorflow', 'horovod', 'mpi4py'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code, str(BENCH)], check=True)


def test_markdown_grid_and_section_text():
    grid = harness.markdown_grid(["size", "a", "b"], [["4 KB", "1", "2"], ["8 KB", "3", "4"]])
    assert grid.splitlines() == ["| size | a | b |", "|---|---:|---:|", "| 4 KB | 1 | 2 |",
                                 "| 8 KB | 3 | 4 |"]
    text = harness.section_text("T", "cmd", {"cores": 2}, ["cap\n\n" + grid, grid], ["n1"],
                                date="d")
    assert text.count("| size | a | b |") == 2 and text.endswith("\n- n1\n")
    assert "```\ncmd\n```" in text and "cap\n\n| size" in text


import allreduce  # noqa: E402
import ddp  # noqa: E402
import launch  # noqa: E402


def _allreduce_records(size, values):
    """Canned worker records: ``values[slot]`` is that slot's per-round algbw list."""
    names = ["raw (A)", "Horovod gloo (B)", "raw (A', A/A control)", "memory copy (C)"]
    return [{"size": size, "round": r, "slot": slot, "variant": names[slot], "algbw_GBps": v}
            for slot, series in enumerate(values) for r, v in enumerate(series)]


def test_allreduce_tables_ratios_bus_bandwidth_and_verdict():
    records = (_allreduce_records(4096, [[1.0, 3.0], [1.0, 1.0], [2.0, 2.0], [4.0, 4.0]])
               + _allreduce_records(64 << 20, [[2.0, 2.0], [1.5, 1.7], [2.0, 2.2], [8.0, 8.0]]))
    tables = allreduce.by_size(records, rounds=2)
    assert list(tables) == [4096, 64 << 20]
    small = tables[4096]
    assert [r.median for r in small] == [2.0, 1.0, 2.0, 4.0] and small[1].ratio == 0.5
    row = allreduce.table_row(4096, small, ranks=2)
    assert row[0] == "4 KB" and row[1] == "2 (1-3)" and row[5] == "4"
    assert row[6:] == ["0.5", "0.25", "0.500", "1.000"]
    assert allreduce.bus(1.0, 2) == 1.0 and allreduce.bus(1.0, 4) == 1.5
    assert allreduce.verdict("gloo", tables).endswith("64 MB 0.80 (A/A 1.05): target >= 0.8 met")
    missed = allreduce.by_size(_allreduce_records(256 << 20, [[2.0], [1.0], [2.0], [4.0]]), 1)
    assert allreduce.verdict("mpi", missed).endswith("missed")
    noisy = allreduce.by_size(_allreduce_records(256 << 20, [[2.0], [1.0], [2.5], [4.0]]), 1)
    assert "inconclusive (would be missed" in allreduce.verdict("mpi", noisy)
    assert "not judged" in allreduce.verdict("mpi", {4096: small})
    assert [allreduce.human(s) for s in (512, 4096, 1 << 20, 256 << 20)] == [
        "512 B", "4 KB", "1 MB", "256 MB"]


def test_allreduce_default_sizes_span_4_kb_to_256_mb():
    args = allreduce.parse_args([])
    assert args.sizes[0] == 4096 and args.sizes[-1] == 256 << 20 and len(args.sizes) == 9
    assert allreduce.parse_args(["--quick"]).rounds == 1
    with pytest.raises(SystemExit):
        allreduce.parse_args(["--controllers", "nccl"])


def test_ddp_verdict_names_both_controllers_and_the_control():
    rows = harness.summarize({ddp.BASELINE: [10.0], ddp.GLOO: [11.0], ddp.MPI: [9.0],
                              ddp.HANDWRITTEN: [8.8], ddp.CONTROL: [10.5]}, baseline=ddp.BASELINE)
    text = ddp.verdict(rows)
    assert "hvdtrain horovodrun gloo / DDP = 1.100 (met)" in text
    noisy = harness.summarize({ddp.BASELINE: [10.0], ddp.GLOO: [11.0], ddp.MPI: [9.0],
                               ddp.HANDWRITTEN: [8.8], ddp.CONTROL: [12.0]},
                              baseline=ddp.BASELINE)
    assert "gloo / DDP = 1.100 (inconclusive (would be met, but the A/A control is off by more " \
        "than 10%))" in ddp.verdict(noisy)
    assert "hvdtrain horovodrun mpi / DDP = 0.900 (missed)" in text
    assert "A/A control = 1.050; hand-written Horovod / DDP = 0.880, hvdtrain gloo / " \
        "hand-written Horovod = 1.250" in text


def test_run_jobs_interleaves_separate_jobs_with_their_environment():
    # Real processes (a bare interpreter, milliseconds each): each prints its variable.
    code = ("import json, os; print('noise'); "
            "print(json.dumps({'v': float(os.environ['BENCH_V'])}))")
    argv = [sys.executable, "-c", code]
    jobs = [launch.Job(name, argv, {"BENCH_V": value})
            for name, value in (("A", "1"), ("B", "2"), ("A'", "3"))]
    results = launch.run_jobs(jobs, rounds=2, warmup=1, key="v", timeout=60)
    assert harness.samples_of(results, "v") == {"A": [1.0, 1.0], "B": [2.0, 2.0], "A'": [3.0, 3.0]}
    assert [m["round"] for m in results["B"]] == [0, 1]
    failing = [launch.Job("X", [sys.executable, "-c", "raise SystemExit(3)"], {})]
    with pytest.raises(harness.BenchError, match="exit code 3"):
        launch.run_jobs(failing, rounds=1, warmup=0, key="v", timeout=60)


def test_synthetic_images_are_deterministic_shaped_and_learnable():
    import numpy as np

    from hvdtrain.errors import HvdtrainError
    from hvdtrain.registry import DATASETS
    from hvdtrain.synthetic import SyntheticImages

    make = DATASETS.get("synthetic_images")
    data = make(train_samples=300, test_samples=100, channels=2, height=5, width=4,
                num_classes=3, noise=1.0, seed=7)
    again = SyntheticImages(train_samples=300, test_samples=100, channels=2, height=5, width=4,
                            num_classes=3, noise=1.0, seed=7)
    assert data.spec().input_shape == (2, 5, 4) and data.spec().num_classes == 3
    assert data.train().x.shape == (300, 2, 5, 4) and data.train().x.dtype == np.float32
    assert data.test().y.dtype == np.int64 and set(data.train().y) == {0, 1, 2}
    assert np.array_equal(data.train().x, again.train().x)
    assert not np.array_equal(data.train().x, SyntheticImages(seed=8, train_samples=300,
                              channels=2, height=5, width=4, num_classes=3).train().x)
    # Learnable: class means of the training split classify most test samples right.
    train, test = data.train(), data.test()
    means = np.stack([train.x[train.y == c].mean(axis=0) for c in range(3)])
    distances = ((test.x[:, None] - means[None]) ** 2).sum(axis=(2, 3, 4))
    assert (distances.argmin(axis=1) == test.y).mean() > 0.9
    with pytest.raises(HvdtrainError, match="data.options.height=0"):
        SyntheticImages(height=0)
    with pytest.raises(HvdtrainError, match="data.options.noise=-1"):
        SyntheticImages(noise=-1)


import compression  # noqa: E402


def test_compression_verdicts_compare_each_framework_with_its_own_none():
    records = [{"framework": "torch", "dataset": "digits", "method": m, "accuracy": a}
               for m, a in [("none", 0.97), ("none", 0.96), ("fp16", 0.962), ("qsgd", 0.955),
                            ("topk", 0.956), ("powersgd", 0.966)]]
    text = compression.accuracy_verdicts(records)[0]
    assert text.startswith("Accuracy bars, torch digits, mean over seeds against none: ")
    assert "fp16 -0.30 points (met, bar -0.5)" in text and "qsgd -1.00 points (missed" in text
    assert "topk -0.90 points (met, bar -1)" in text and "powersgd +0.10 points (met" in text
    slow = [{"framework": fw, "method": m, "to_target_s": t, "step_ms": 1.0, "ratio": 1.0,
             "accuracy": 0.95}
            for fw, base in (("torch", 60.0), ("tensorflow", 30.0))
            for m, t in (("none", base), ("topk", None), ("powersgd", 5.0))]
    assert "| tensorflow powersgd | 5.0 | 6.00 |" in compression.slow_table(slow, 0.93)
    assert compression.notes([], slow)[-2:] == [
        "Slow link, torch: best method powersgd reaches the target 12.0x sooner than none "
        "(target: >= 3x).",
        "Slow link, tensorflow: best method powersgd reaches the target 6.0x sooner than none "
        "(target: >= 3x)."]
