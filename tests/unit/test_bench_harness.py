"""The benchmark harness and drivers on canned inputs: numbers and structure, never wording."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
BENCH = ROOT / "benchmarks"
INVESTIGATIONS = ROOT / "docs" / "investigations"
ALLREDUCE = INVESTIGATIONS / "allreduce-bandwidth"
FUSION = INVESTIGATIONS / "tensor-fusion"
TIMELINE = INVESTIGATIONS / "step-overhead"
sys.path[:0] = [str(BENCH), str(ALLREDUCE), str(TIMELINE)]
import allreduce  # noqa: E402
import timeline  # noqa: E402

import compression  # noqa: E402
import data as data_bench  # noqa: E402
import ddp  # noqa: E402
import harness  # noqa: E402
import index  # noqa: E402
import monitoring  # noqa: E402
import overhead  # noqa: E402
import plan_check  # noqa: E402
import resnet_worker  # noqa: E402
import scaling  # noqa: E402
import workload  # noqa: E402

DRIVERS = ("allreduce", "checkpoint", "cluster", "compression", "data", "ddp", "elastic_recovery",
           "frameworks", "fusion", "monitoring", "overhead", "scaling", "startup")
"""Every driver: those of ``benchmarks/`` and of the investigations."""


def test_summarize_gives_min_median_max_ratio_and_interval():
    rows = harness.summarize({"A": [3.0, 1.0, 2.0], "B": [4.0, 2.0, 6.0, 5.0]}, baseline="A")
    assert [(r.name, r.runs, r.min, r.median, r.max, r.ratio) for r in rows] == [
        ("A", 3, 1.0, 2.0, 3.0, 1.0), ("B", 4, 2.0, 4.5, 6.0, 2.25)]
    assert all(r.low <= r.ratio <= r.high for r in rows)


@pytest.mark.parametrize("samples", [{"A": [1.0]}, {"X": [1.0], "B": []}, {"X": [0.0]}])
def test_summarize_rejects_a_missing_baseline_an_empty_variant_and_a_zero_median(samples):
    with pytest.raises(ValueError):
        harness.summarize(samples, baseline="X")


def test_ratio_interval_pairs_rounds_so_a_slow_round_weighs_on_both_sides():
    base = [1.0, 2.0, 4.0, 1.5, 3.0, 2.5, 1.2]  # rounds of very different speed
    values = [1.1 * b for b in base]  # every round: exactly 10% slower
    assert harness.ratio_interval(base, values) == pytest.approx((1.1, 1.1))
    low, high = harness.ratio_interval(base, values[:-1])  # unequal counts: resampled apart
    assert high - low > 0.5
    assert harness.ratio_interval(base, values[:-1]) == (low, high)  # seeded


@pytest.mark.parametrize("ratio, control, higher, status", [
    (1.02, 1.005, False, "met"), (1.05, 0.995, False, "missed"),
    (1.00, 1.02, False, "inconclusive"), (1.00, 0.98, False, "inconclusive"),
    (0.95, 1.0, True, "met"), (0.85, 1.0, True, "missed")])
def test_judge(ratio, control, higher, status):
    target = 0.9 if higher else 1.03
    verdict = harness.judge(ratio, control, target, 0.01, higher_is_better=higher)
    assert (verdict.status, verdict.ratio, verdict.control) == (status, ratio, control)


def cells(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()]


def test_markdown_table_columns_and_cells():
    rows = harness.summarize({"A": [0.010, 0.012], "B": [0.011, 0.0121]}, baseline="A")
    head, rule, a, b = cells(harness.markdown_table(rows))
    assert head == ["name", "runs", "min (ms)", "median (ms)", "max (ms)", "ratio to baseline",
                    "ratio 95% interval"]
    assert len(rule) == len(head)
    assert a == ["A", "2", "10.000", "11.000", "12.000", "1.000", ""]
    assert b[:6] == ["B", "2", "11.000", "11.550", "12.100", "1.050"]
    low, high = map(float, b[6].split("-"))
    assert low <= 1.05 <= high


def test_sections_replace_their_own_copy_and_keep_the_others(tmp_path):
    rows = harness.summarize({"A": [1.0]}, baseline="A")
    section = harness.section_text("T", "python x.py --flag", {"cores": 2},
                                   [harness.table_block("cap", rows)], ["n1"], date="d")
    lines = section.splitlines()
    assert lines[0] == "## T" and lines[-1] == "- n1"
    assert lines.index("python x.py --flag") == lines.index("```") + 1
    assert "cap" in lines and lines[lines.index("cap") + 2].startswith("| name |")
    doc = tmp_path / "docs" / "b.md"
    harness.put_section(doc, section)
    harness.put_section(doc, section.replace("## T", "## U"))
    harness.put_section(doc, section.replace("- n1", "- n2"))
    text = doc.read_text()
    assert [line for line in text.splitlines() if line.startswith("#")] == [
        "# Benchmarks", "## T", "## U"]
    before_u, after_u = text.split("## U")
    assert "- n2" in before_u and "- n1" not in before_u and "- n1" in after_u


def test_a_section_carries_its_index_lines_and_writing_it_refreshes_the_index(tmp_path):
    rows = harness.summarize({"A": [1.0], "B": [1.1]}, baseline="A")
    verdict = harness.judge(1.1, 1.0, 1.2)
    entry = harness.Entry(label="L", script="x.py", target="B / A <= 1.2",
                          verdict=harness.brief(verdict, rows[1]))
    assert entry.verdict == "met: 1.100 (interval 1.100-1.100), A/A 1.000"
    section = harness.section_text("T", "python x.py", {"cores": 2},
                                   [harness.table_block("", rows)], ["n1"], entry=entry, date="d")
    assert index.parse(section) == entry
    assert section.splitlines()[:5] == ["## T", "", entry.lines().splitlines()[0],
                                        "Verdict: " + entry.verdict, ""]
    doc = tmp_path / "b.md"
    doc.write_text(f"# Benchmarks\n\n{index.BEGIN}\n{index.END}\n")
    harness.put_section(doc, section)
    text = doc.read_text()
    assert index.render(text) == text and "| [L](#t) | met: 1.100" in text
    harness.put_section(doc, section.replace("met: 1.100", "met: 1.000"))
    assert "| met: 1.000 (interval" in doc.read_text()


def test_parse_measurements_reads_every_tagged_line_of_one_job_in_order():
    out = ("[1]<stdout>:noise\n"
           "[0]<stdout>:{\"round\": -1, \"t\": 0.5}\n"
           "[0]<stdout>:{\"round\": 0, \"t\": 0.25}[1,0]<stdout>:\n"
           "{\"other\": 1}\n[0]<stdout>:{broken\n"
           "[1,0]<stdout>:{\"round\": 1, \"t\": 0.75}\n")
    assert harness.parse_measurements(out, "t") == [
        {"round": -1, "t": 0.5}, {"round": 0, "t": 0.25}, {"round": 1, "t": 0.75}]
    assert harness.parse_measurements(out, "missing") == []


def test_round_order_alternates_and_warm_up_is_reversed():
    assert harness.round_order("ABC", 0) == ["A", "B", "C"]
    assert harness.round_order("ABC", 1) == ["C", "B", "A"]
    assert harness.round_order("ABC", -1) == ["C", "B", "A"]


def _records(rounds, slots, warmup=1):
    return [{"round": r, "slot": s, "t": 10 * r + s}
            for r in range(-warmup, rounds) for s in harness.round_order(range(slots), r)]


def test_group_runs_maps_slots_to_names_drops_warm_up_and_rejects_short_jobs():
    results = harness.group_runs(_records(2, 3), ["A", "B", "A'"], rounds=2)
    assert harness.samples_of(results, "t") == {"A": [0.0, 10.0], "B": [1.0, 11.0],
                                                "A'": [2.0, 12.0]}
    with pytest.raises(harness.BenchError):
        harness.group_runs(_records(2, 3), ["A", "B", "A'"], rounds=3)
    with pytest.raises(ValueError):
        harness.group_runs(_records(1, 2), ["A", "A"], rounds=1)


def test_run_jobs_interleaves_separate_jobs_with_their_environment():
    code = "import json, os; print('noise'); print(json.dumps({'v': float(os.environ['BENCH_V'])}))"
    jobs = [harness.Job(name, [sys.executable, "-c", code], {"BENCH_V": value})
            for name, value in (("A", "1"), ("B", "2"), ("A'", "3"))]
    results = harness.run_jobs(jobs, rounds=2, warmup=1, key="v", timeout=60)
    assert harness.samples_of(results, "v") == {"A": [1.0, 1.0], "B": [2.0, 2.0], "A'": [3.0, 3.0]}
    assert [m["round"] for m in results["B"]] == [0, 1]
    failing = [harness.Job("X", [sys.executable, "-c", "raise SystemExit(3)"], {})]
    with pytest.raises(harness.BenchError):
        harness.run_jobs(failing, rounds=1, warmup=0, key="v", timeout=60)


def test_job_main_runs_every_variant_once_a_round_in_alternating_order(tmp_path, monkeypatch,
                                                                        capsys):
    (tmp_path / "fake_worker.py").write_text(
        "VARIANTS = {k: (lambda k: lambda epochs, out: {'rank': 0, 'k': k, 'epochs': epochs,\n"
        "                                                'out': str(out)})(k) for k in 'ab'}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert workload.job_main(["--variants", "fake_worker:a,fake_worker:b,fake_worker:a",
                             "--rounds", "2", "--warmup", "1", "--epochs", "3",
                             "--out-dir", str(tmp_path)]) == 0
    records = harness.parse_measurements(capsys.readouterr().out, "k")
    assert [(r["round"], r["slot"], r["k"]) for r in records] == [
        (-1, 2, "a"), (-1, 1, "b"), (-1, 0, "a"), (0, 0, "a"), (0, 1, "b"), (0, 2, "a"),
        (1, 2, "a"), (1, 1, "b"), (1, 0, "a")]
    assert {r["epochs"] for r in records} == {3} and records[0]["out"].endswith("slot2")


def test_parse_fills_sizes_and_the_command_repeats_the_run():
    def parser():
        p = harness.parser("x.py", "d", {"rounds": (60, 1), "epochs": (4, 2)}, interleaved=True)
        p.add_argument("--env", action="append", default=[])
        return p

    quick = harness.parse(parser(), ["--quick", "--env", "A=1", "--env", "B=2", "--spin"])
    assert (quick.rounds, quick.epochs, quick.spin, quick.bind) == (1, 2, True, False)
    full = harness.parse(parser(), ["--epochs", "7"])
    assert (full.rounds, full.epochs) == (60, 7)
    argv = shlex.split(quick.command)
    assert argv[1] == "benchmarks/x.py" and "--quick" not in argv
    again = harness.parse(parser(), argv[2:])
    assert {k: v for k, v in vars(again).items() if k != "quick"} == \
        {k: v for k, v in vars(quick).items() if k != "quick"}
    with pytest.raises(SystemExit):
        harness.parse(parser(), ["--rounds", "0"])


def test_an_investigations_driver_is_reproduced_from_its_own_path_into_its_note():
    args = allreduce.parse_args(["--quick"])
    assert shlex.split(args.command)[1] == "docs/investigations/allreduce-bandwidth/allreduce.py"
    assert args.output == INVESTIGATIONS / "allreduce-bandwidth.md"


def test_clock_and_measurement(monkeypatch):
    now = iter([0.0, 1.0, 3.0, 6.0, 10.0, 15.0, 16.0, 17.0])
    monkeypatch.setattr(workload.time, "perf_counter", lambda: next(now))
    monkeypatch.setattr(workload, "process_age_s", lambda: 5.0)
    clock = workload.Clock()
    for _ in range(4):  # two epochs of two steps
        clock.step()
    clock.evaluation()
    clock.evaluation()  # a later evaluation does not move the end
    assert clock.steady_seconds(2) == 10.0 - 3.0  # step 3 (epoch 2) to the evaluation
    assert clock.steady_seconds(1) is None
    record = workload.measurement(0, 4, 400, 14.0, 0.9, clock, epochs=2)
    assert record == {"rank": 0, "steps": 4, "samples": 400, "wall_time_s": 14.0,
                      "step_time_s": 3.5, "samples_per_s": 400 / 14.0,
                      "steady_step_time_s": 3.5, "steady_samples_per_s": 200 / 7.0,
                      "eval_accuracy": 0.9, "startup_s": 5.0}
    unevaluated = workload.Clock()
    unevaluated.step()
    unevaluated.step()
    assert unevaluated.steady_seconds(2) is None


def test_report_prints_rank_zero_only(capsys):
    workload.report({"rank": 1, "steps": 3})
    workload.report({"rank": 0, "steps": 3})
    assert json.loads(capsys.readouterr().out) == {"rank": 0, "steps": 3}


def test_drivers_import_no_framework():
    # In a process of its own: the suite's process may hold the frameworks for other tiers.
    code = (f"import sys; sys.path[:0] = sys.argv[1:]; import {', '.join(DRIVERS)}\n"
            "assert not {'torch', 'tensorflow', 'horovod', 'mpi4py'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code, str(BENCH), str(ALLREDUCE), str(FUSION)],
                   check=True)


def test_machine_record_names_cores_and_versions():
    record = harness.machine_record()
    assert record["cores"] >= 1 and {"cpu", "os", "python", "torch", "horovod"} <= set(record)


def test_hvdtrain_worker_clocks_through_a_loop_callback_and_switches_sinks_by_config(tmp_path):
    import hvdtrain_worker
    from hvdtrain.config import load_config
    from hvdtrain.loop import Callback

    clock = workload.Clock()
    clocked = hvdtrain_worker.Clocked(clock)
    assert isinstance(clocked, Callback)
    clocked.on_step_start(0)
    clocked.on_step_start(1)
    clocked.on_evaluate_start()
    assert len(clock.step_starts) == 2 and clock.eval_start >= clock.step_starts[-1]
    switches = ("jsonl", "tensorboard", "system", "console")
    for sinks, on in (("on", True), ("off", False)):
        cfg = load_config(hvdtrain_worker.CONFIGS["torch"],
                          hvdtrain_worker.overrides("torch", 3, tmp_path, sinks), environ={})
        assert [getattr(cfg.log, name) for name in switches] == [on] * 4
        assert (cfg.log.wandb != "disabled") is on and cfg.train.eval_every_epochs == 3
    assert set(hvdtrain_worker.VARIANTS) == {"hvdtrain_torch", "hvdtrain_tf", "sinks_on_torch",
                                             "sinks_off_torch", "sinks_on_tf", "sinks_off_tf"}


def test_step_time_drivers_compare_the_right_variants():
    assert [v.spec for v in monitoring.variants("tensorflow")] == [
        "hvdtrain_worker:sinks_off_tf", "hvdtrain_worker:sinks_on_tf",
        "hvdtrain_worker:sinks_off_tf"]
    specs = [v.spec for v in overhead.variants("torch")]
    assert specs[0] == specs[2] == "handwritten_torch:handwritten_torch"
    rows = harness.summarize({overhead.BASELINE: [1.0, 1.0], overhead.CANDIDATE: [1.02, 1.04],
                              overhead.CONTROL: [1.0, 1.01]}, overhead.BASELINE)
    assert [(v.status, v.ratio) for v in overhead.verdicts(rows)] == [("met", 1.03)]


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
    assert allreduce.table_row(4096, small, ranks=2) == [
        "4 KB", "2 (1-3)", "1 (1-1)", "2", "1", "4", "0.5", "0.25", "0.500", "1.000"]
    assert allreduce.bus(1.0, 2) == 1.0 and allreduce.bus(1.0, 4) == 1.5
    met = allreduce.verdict(tables)
    assert (met.status, met.ratio, met.control) == ("met", pytest.approx(0.8), pytest.approx(1.05))
    missed = allreduce.by_size(_allreduce_records(256 << 20, [[2.0], [1.0], [2.0], [4.0]]), 1)
    assert allreduce.verdict(missed).status == "missed"
    noisy = allreduce.by_size(_allreduce_records(256 << 20, [[2.0], [1.0], [2.5], [4.0]]), 1)
    assert allreduce.verdict(noisy).status == "inconclusive"
    assert allreduce.verdict({4096: small}) is None
    assert [allreduce.human(s) for s in (512, 4096, 1 << 20, 256 << 20)] == [
        "512 B", "4 KB", "1 MB", "256 MB"]


def test_allreduce_sizes_default_to_4_kb_through_256_mb():
    sizes = [int(s) for s in allreduce.parse_args([]).sizes.split(",")]
    assert sizes[0] == 4096 and sizes[-1] == 256 << 20 and len(sizes) == 9
    assert allreduce.parse_args(["--quick"]).rounds == 1
    with pytest.raises(SystemExit):
        allreduce.parse_args(["--controllers", "nccl"])


def test_ddp_and_scaling_verdicts_from_their_ratios():
    rows = harness.summarize({ddp.BASELINE: [10.0], ddp.GLOO: [11.0], ddp.MPI: [9.0],
                              ddp.HANDWRITTEN: [8.8], ddp.CONTROL: [10.5]}, baseline=ddp.BASELINE)
    verdicts = ddp.verdicts(rows)
    assert {name: (v.status, v.ratio) for name, v in verdicts.items()} == {
        ddp.GLOO: ("met", 1.1), ddp.MPI: ("missed", 0.9)}
    noisy = harness.summarize({ddp.BASELINE: [10.0], ddp.GLOO: [11.0], ddp.MPI: [9.0],
                               ddp.HANDWRITTEN: [8.8], ddp.CONTROL: [12.0]}, ddp.BASELINE)
    assert {v.status for v in ddp.verdicts(noisy).values()} == {"inconclusive"}
    rows = harness.summarize({scaling.ONE: [10.0], scaling.TWO: [19.0], scaling.CEILING: [20.0],
                              scaling.CONTROL: [10.0]}, scaling.ONE)
    efficiency = scaling.efficiency(rows)
    assert (efficiency.status, efficiency.ratio) == ("met", pytest.approx(0.95))


def test_resnet_worker_phases_are_each_parts_median_and_ddp_notes_them():
    marks = [[0.0, 0.010, 0.030, 0.030, 0.031], [1.0, 1.020, 1.050, 1.052, 1.055],
             [2.0, 2.030, 2.070, 2.071, 2.073]]
    phases = {"forward": 20.0, "backward": 30.0, "wait": 1.0, "update": 2.0}
    assert resnet_worker.phases_ms(marks) == phases
    other = {phase: 2 * ms for phase, ms in phases.items()}
    results = {ddp.BASELINE: [{"phases_ms": phases}] * 2 + [{"phases_ms": other}],
               ddp.HANDWRITTEN: [{"phases_ms": other}], ddp.CONTROL: [{"phases_ms": phases}]}
    note = ddp.phases_note(results)
    assert note.count("20.0 / 30.0 / 1.0 / 2.0") == 2 and "40.0 / 60.0 / 2.0 / 4.0" in note


def test_compression_accuracy_drops_and_slow_link_speedups():
    records = [{"framework": "torch", "dataset": "digits", "method": m, "accuracy": a}
               for m, a in [("none", 0.97), ("none", 0.96), ("fp16", 0.962), ("qsgd", 0.955),
                            ("topk", 0.956), ("powersgd", 0.966)]]
    drops = compression.accuracy_drops(records)["torch"]
    assert {m: (round(100 * d, 2), ok) for m, (d, ok) in drops.items()} == {
        "fp16": (-0.3, True), "qsgd": (-1.0, False), "topk": (-0.9, True), "powersgd": (0.1, True)}
    slow = [{"framework": fw, "method": m, "to_target_s": t, "step_ms": 1.0, "ratio": 1.0,
             "accuracy": 0.95}
            for fw, base in (("torch", 60.0), ("tensorflow", 30.0))
            for m, t in (("none", base), ("topk", None), ("powersgd", 5.0))]
    assert compression.speedups(slow) == {
        "torch": {"none": 1.0, "topk": None, "powersgd": 12.0},
        "tensorflow": {"none": 1.0, "topk": None, "powersgd": 6.0}}
    rows = cells(compression.slow_table(slow, 0.93))
    assert rows[0][:3] == ["framework method", "time to 0.93 s", "sooner than none (x)"]
    assert rows[-1][:3] == ["tensorflow powersgd", "5.0", "6.00"]


def test_compression_lm_loss_is_the_paired_relative_perplexity_increase():
    records = [{"framework": "torch", "dataset": "lm", "optimizer": "adam", "method": m,
                "seed": seed, "perplexity": ppl, "wire_per_step": 1.0, "ratio": 1.0,
                "compress_ms": None, "step_ms": 1.0}
               for m, seed, ppl in [("none", 0, 16.0), ("none", 1, 20.0), ("topk", 0, 16.4),
                                    ("topk", 1, 20.2), ("qsgd", 0, 16.0)]]
    base = [r for r in records if r["method"] == "none"]
    topk = [r for r in records if r["method"] == "topk"]
    mean, half, n = compression.paired_loss(topk, base, compression.PERPLEXITY)
    assert (mean, n) == (pytest.approx(0.0175), 2)  # (2.5% + 1%) / 2, not (36.6 - 36) / 36
    assert half == pytest.approx(12.71 * 0.015 / 2 ** 0.5 / 2 ** 0.5)
    losses = cells(compression.loss_table(records, ["none", "topk", "qsgd"],
                                          compression.PERPLEXITY))
    assert losses[0][2] == "perplexity increase vs none (%)"
    assert losses[2][:3] == ["torch lm adam topk", "2", "+1.75"]
    assert losses[2][4:] == ["2", "met (interval crosses the bar)"]  # bar: 2%
    results = cells(compression.results_table(records, ["none", "topk"], compression.PERPLEXITY))
    assert results[0][2:4] == ["perplexity mean", "perplexity min–max"]
    assert results[2][:3] == ["torch lm adam none", "2", "18.00"]
    assert compression.verdict(records) == "torch lm adam topk met (loss +1.75% perplexity)"


def test_compression_lm_trains_on_the_lm_config_with_its_own_optimizer():
    assert compression.config_of("tensorflow", "lm").name == "lm_tf.yaml"
    assert compression.config_of("torch", "digits").name == "digits_torch.yaml"
    assert compression.optimizers_of("lm", None) == ["adam"]
    assert compression.optimizers_of("digits", None) == ["sgd"]
    assert compression.optimizers_of("lm", "sgd,adam") == ["sgd", "adam"]
    assert compression.optimizer_overrides("lm", "adam") == []
    assert "optim.name=sgd" in compression.optimizer_overrides("lm", "sgd")
    assert compression.parse_args(["--quick"]).lm_steps == 20
    assert compression.parse_args([]).lm_steps == 150


def test_compression_images_train_resnet18_with_its_own_optimizer_and_are_judged_by_the_bars():
    assert compression.config_of("torch", "images").name == "images_torch.yaml"
    assert compression.config_of("tensorflow", "images").name == "images_tf.yaml"
    assert compression.optimizers_of("images", None) == ["adam"]
    assert compression.optimizer_overrides("images", "adam") == []
    assert "optim.name=sgd" in compression.optimizer_overrides("images", "sgd")
    assert "train.max_steps=200" in compression.image_overrides(Path("/x"), 200)
    assert compression.parse_args(["--quick"]).image_steps == 10
    records = [{"framework": "torch", "dataset": "images", "optimizer": "sgd", "method": m,
                "seed": seed, "accuracy": acc}
               for m, seed, acc in [("none", 0, 0.80), ("none", 1, 0.84), ("topk", 0, 0.78),
                                    ("topk", 1, 0.83), ("qsgd", 0, 0.80), ("qsgd", 1, 0.841),
                                    ("topk-dgc", 0, 0.70)]]  # topk-dgc: no bar, not judged
    assert compression.verdict(records) == ("torch images sgd topk missed by 0.50 points (loss "
                                            "+1.50 points); torch images sgd qsgd met (loss "
                                            "-0.05 points)")
    digits = [{**r, "dataset": "digits"} for r in records]
    assert compression.verdict(digits + records).endswith(compression.verdict(records))
    args = compression.parse_args(["--datasets", "images,lm", "--seeds", "3", "--lm-steps", "300"])
    assert compression.title_of(args)[0] == ("Gradient compression, ResNet-18 on generated images, "
                                             "200 steps, language model, 300 steps: 3 seeds, torch")
    assert compression.title_of(compression.parse_args(["--seeds", "1"]))[0] == (
        "Gradient compression: 1 seed, torch")
    assert compression.target_text(["images"]) == compression.IMAGES_TARGET_TEXT
    assert compression.target_text(["digits", "lm"]).startswith(compression.TARGET_TEXT)


def test_compression_topk_01_on_the_mlps_is_judged_by_issue_36s_bar_and_a_tag_names_the_run():
    records = [{"framework": "torch", "dataset": ds, "optimizer": "sgd", "method": m,
                "seed": seed, "accuracy": acc}
               for ds in ("digits", "mnist1d")
               for m, seed, acc in [("none", 0, 0.90), ("none", 1, 0.92),
                                    ("topk-0.1%", 0, 0.89), ("topk-0.1%", 1, 0.90)]]
    assert compression.verdict(records) == ("torch digits sgd topk-0.1% met (loss +1.50 points); "
                                            "torch mnist1d sgd topk-0.1% met (loss +1.50 points)")
    records += [{**records[3], "method": "topk", "accuracy": 0.91}]  # digits, seed 1: its bars too
    assert compression.verdict(records).startswith("torch met (highest loss: topk")
    assert compression.target_text(["digits"], ["none", "topk-0.1%"]) == (
        compression.TARGET_TEXT + "; the MLPs: `topk-0.1%` 2 points (issue 36)")
    assert compression.target_text(["digits"], ["none", "topk"]) == compression.TARGET_TEXT
    assert compression.target_text(["images"], ["none", "topk-0.1%"]) == (
        compression.IMAGES_TARGET_TEXT)
    args = compression.parse_args(["--datasets", "images", "--tag", "topk-0.1%"])
    assert compression.title_of(args) == (
        "Gradient compression, ResNet-18 on generated images, 200 steps: 5 seeds, torch, topk-0.1%",
        "Gradient compression, ResNet-18 on generated images, 200 steps, 5 seeds, torch, topk-0.1%")
    assert "--tag topk-0.1%" in args.command
    lm = [{"framework": "torch", "dataset": "lm", "optimizer": "adam", "method": m, "seed": 0,
           "perplexity": ppl} for m, ppl in [("none", 10.0), ("topk-0.1%", 15.0)]]
    assert compression.verdict(lm) == ("no method with a bar on its model measured; against "
                                       "`none`: torch lm adam topk-0.1% +50.00% perplexity")
    assert compression.verdict(lm[:1]) == "no method with an accuracy bar measured"


def test_synthetic_images_are_deterministic_shaped_and_learnable():
    import numpy as np

    from hvdtrain.data.synthetic import SyntheticImages
    from hvdtrain.errors import HvdtrainError
    from hvdtrain.registry import DATASETS

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
    with pytest.raises(HvdtrainError, match=r"data.options.height=0"):
        SyntheticImages(height=0)
    with pytest.raises(HvdtrainError, match=r"data.options.noise=-1"):
        SyntheticImages(noise=-1)


def test_data_bench_wait_share_weights_records_by_their_steps_and_skips_the_first_epoch():
    import data_worker

    records = [{"step": 4, "epoch": 0, "data_wait_time_s": 1.0, "step_time_s": 2.0},
               {"step": 5, "epoch": 0, "data_wait_time_s": 0.0, "step_time_s": 2.0},
               {"step": 9, "epoch": 1, "data_wait_time_s": 0.1, "step_time_s": 1.0},
               {"step": 10, "epoch": 1, "data_wait_time_s": 0.6, "step_time_s": 1.0},
               {"step": 11, "epoch": 1, "step_time_s": 1.0}]  # no wait figure: left out
    assert data_worker.wait_share(records) == pytest.approx((4 * 1.0 + 0.4 + 0.6) / (10 + 4 + 1))
    assert data_worker.wait_share(records, first_epoch=1) == pytest.approx(1.0 / 5)
    assert data_worker.wait_share(records, first_epoch=2) is None


def test_data_bench_verdicts_and_tables_from_canned_runs():
    names = [v.name for v in data_bench.loading_variants("tensorflow")]
    assert names == [data_bench.MEMORY, data_bench.DISK, data_bench.DISK0, data_bench.CONTROL]
    assert [v.spec for v in data_bench.loading_variants("tensorflow")] == [
        "data_worker:memory_tf", "data_worker:disk_tf", "data_worker:disk0_tf",
        "data_worker:memory_tf"]
    speed = {data_bench.MEMORY: [100.0, 200.0], data_bench.DISK: [96.0, 192.0],
             data_bench.DISK0: [48.0, 96.0], data_bench.CONTROL: [101.0, 202.0]}
    verdict = data_bench.speed_verdict(harness.summarize(speed, data_bench.MEMORY))
    assert (verdict.status, verdict.ratio) == ("met", pytest.approx(0.96))
    speed[data_bench.CONTROL] = [110.0, 220.0]  # A/A off by 10%: not judged
    assert data_bench.speed_verdict(harness.summarize(speed, data_bench.MEMORY)).status == \
        "inconclusive"
    assert data_bench.workers_gain(speed) == pytest.approx((2.0, 2.0, 2.0))
    runs = {name: [{"data_wait_share": share}, {"data_wait_share": None}]
            for name, share in zip(names, (0.001, 0.04, 0.2, 0.002), strict=True)}
    shares = data_bench.wait_shares(runs)
    assert shares[data_bench.DISK] == [0.04]
    assert cells(data_bench.wait_table(shares))[3] == [data_bench.DISK, "1", "4.00", "4.00",
                                                       "4.00"]
    wait = data_bench.wait_verdict(shares)
    assert (wait.status, wait.share, wait.target) == ("met", 0.04, data_bench.WAIT_TARGET)
    wait = data_bench.wait_verdict({data_bench.DISK: [0.06, 0.04, 0.07]})
    assert (wait.status, wait.share) == ("missed", 0.06)
    memory = {data_bench.SMALL: [300.0, 310.0], data_bench.LARGE: [320.0, 330.0],
              data_bench.SMALL_CONTROL: [305.0, 305.0]}
    tables = {key: harness.summarize(memory, data_bench.SMALL) for key, _ in data_bench.MEMORY_KEYS}
    assert {v.status for v in data_bench.memory_verdicts(tables).values()} == {"met"}


def test_data_bench_sets_load_through_hvdtrain_and_preloaded_images_equal_the_folder(tmp_path):
    import numpy as np

    import data_worker
    from hvdtrain.config import load_config
    from hvdtrain.data.image_folder import ImageFolder
    from hvdtrain.data.npy import NpyDataset

    data_bench.write_npy(tmp_path / "npy", 30, 3)
    npy = NpyDataset(str(tmp_path / "npy"), scale=1 / 255)
    assert (len(npy.train()), len(npy.test())) == (30, 3)
    assert npy.spec().input_shape == data_bench.SHAPE
    data_bench.make_images(tmp_path / "images", 20, 10)
    folder = ImageFolder(str(tmp_path / "images"), data_worker.SIZE)
    preloaded = data_worker.PreloadedImages(str(tmp_path / "images"))
    assert preloaded.train().in_memory and preloaded.spec() == folder.spec()
    picks = np.array([3, 0, 19])
    assert np.array_equal(preloaded.train().load(picks).x, folder.train().load(picks).x)
    assert np.array_equal(preloaded.test().load(picks[:2]).y, folder.test().load(picks[:2]).y)
    for framework in ("torch", "tensorflow"):
        for source, workers in (("memory", -1), ("disk", -1), ("disk0", 0)):
            env = {"BENCH_DATA_ROOT": str(tmp_path / "images"), "BENCH_DATA_WIDTH": "8"}
            with pytest.MonkeyPatch.context() as patch:
                for key, value in env.items():
                    patch.setenv(key, value)
                overrides = data_worker.loading_overrides(framework, source, 3, tmp_path / "r")
            cfg = load_config(data_worker.CONFIGS[framework], overrides, environ={})
            assert (cfg.data.workers, cfg.model.options, cfg.train.eval_every_epochs) == \
                (workers, {"width": 8}, 3)
            assert cfg.data.options == {"root": str(tmp_path / "images"), "size": 64}
            assert cfg.log.jsonl and not cfg.checkpoint.enabled
        cfg = load_config(data_worker.CONFIGS[framework],
                          data_worker.memory_overrides(framework, tmp_path / "npy", tmp_path / "r"),
                          environ={})
        assert (cfg.data.name, cfg.data.options["root"]) == ("npy", str(tmp_path / "npy"))


def test_data_bench_peak_memory_counts_child_processes():
    import os

    import data_worker

    with data_worker.PeakMemory(interval=0.05) as alone:
        pass
    code = "import time; x = bytearray(64 << 20); print(flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # the child holds its 64 MB
        assert child.pid in data_worker.children(os.getpid())
        peak = data_worker.PeakMemory()
        peak.sample()
        assert peak.anon_kb >= alone.anon_kb + 60_000
        assert peak.pss_kb >= peak.anon_kb > 0
    finally:
        child.kill()
        child.wait()


def test_timeline_counts_a_fused_response_once_and_the_unnested_rest(tmp_path, capsys):
    # Two tensors fused into one response (the same spans on two "processes"), then one alone.
    def span(pid, name, start, end):
        return [{"ph": "B", "name": name, "ts": start, "pid": pid}, {"ph": "E", "ts": end, "pid": pid}]
    events = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "a"}}]
    for pid in (1, 2):
        events += span(pid, "ALLREDUCE", 0, 10_000)[:1] + span(pid, "MEMCPY_IN_FUSION_BUFFER", 0, 2_000)
        events += span(pid, "GLOO_ALLREDUCE", 2_000, 9_000) + span(pid, "ALLREDUCE", 0, 10_000)[1:]
    events += span(1, "ALLREDUCE", 20_000, 24_000)[:1] + span(1, "GLOO_ALLREDUCE", 20_000, 24_000)
    events += span(1, "ALLREDUCE", 20_000, 24_000)[1:]
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps(events))
    assert timeline.main([str(path), "--steps", "2"]) == 0
    rows = {line[:32].strip(): [float(x) for x in line.split()[-2:]]
            for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["ALLREDUCE"] == [14.0, 7.0]  # ms, and per step
    assert rows["GLOO_ALLREDUCE"] == [11.0, 5.5]
    assert rows["MEMCPY_IN_FUSION_BUFFER"] == [2.0, 1.0]
    assert rows["ALLREDUCE not nested"] == [1.0, 0.5]


def test_plan_check_ranks_ties_as_either_order():
    """A pair the plan orders one way and measurement the other is a disagreement only where the
    measured steps differ by more than plan_check.TIE; Gloo's ring is ranked with the rest."""
    def row(label, predicted, measured):
        return {"rate": "100mbit", "n": 2, "label": label, "predicted": predicted,
                "measured": measured, "link_bound": True}
    close = [row("ring (MPI)", 1.6, 1.67), row("servers S=2", 1.64, 1.64)]
    assert plan_check.swapped(close) == []
    assert ": same but for ties" in plan_check.ranking_agrees(close)[0]
    gloo = plan_check.ranking_agrees([*close, row("ring (Gloo)", 0.1, 9.0)])[0]
    assert "ring (Gloo) planned faster than servers S=2" in gloo and ": differs:" in gloo
    apart = [row("ring (MPI)", 1.6, 2.0), row("servers S=2", 1.64, 1.64)]
    assert plan_check.swapped(apart) == [("ring (MPI)", "servers S=2")]
    line = plan_check.ranking_agrees(apart)
    assert ": differs" in line[0] and plan_check.verdict(apart, line).startswith("not met")


def test_plan_check_judges_only_what_the_link_bounds():
    """A row is judged (its ratio and its place in the judged ranking) only where measurement
    found it link-bound; the table shows the plan's view and the unshaped step beside it."""
    def row(label, predicted, measured, unshaped):
        return {"rate": "1gbit", "n": 4, "label": label, "predicted": predicted,
                "measured": measured, "unshaped": unshaped, "plan_link_bound": True,
                "link_bound": measured - unshaped >= plan_check.LINK_BOUND * measured}
    rows = [row("ring (MPI)", 0.26, 0.27, 0.10), row("ring fp16", 0.15, 0.16, 0.07),
            row("servers S=4", 0.20, 0.42, 0.38)]
    assert [r["link_bound"] for r in rows] == [True, True, False]
    judged = plan_check.ranking_agrees(rows, bound_only=True)
    assert ": same (" in judged[0] and "servers" not in judged[0]
    assert ": differs" in plan_check.ranking_agrees(rows)[0]
    assert plan_check.verdict(rows, judged).startswith("met: link-bound settings measured "
                                                      "1.04-1.07 x")
    assert "| 0.380 | yes | no | — |" in plan_check.table(rows)
    alone = plan_check.ranking_agrees(rows[1:], bound_only=True)
    assert ": nothing to rank (1 link-bound)" in alone[0]
    assert plan_check.verdict(rows[1:], alone).startswith("met:")
    rows[0]["measured"] = 0.4  # 1.54 x its plan
    assert plan_check.verdict(rows, judged).startswith("not met")
