"""``hvdtrain report`` on canned run directories: the PNGs, the table, missing metrics, bad input."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml

from hvdtrain.cli import main
from hvdtrain.errors import HvdtrainError
from hvdtrain.observe.report import report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_run(path: Path, name: str, framework: str, *, summary: bool = True, wall: bool = True,
             comm: bool = False, stages: int = 0) -> Path:
    """A run directory with 2 epochs of 20 steps, logged every 10, evaluated per epoch."""
    path.mkdir(parents=True)
    records = []
    for step in (10, 20, 30, 40):
        record = {"step": step, "epoch": (step - 1) // 20, "loss": 2.0 / step, "accuracy": step / 50,
                  "lr": 0.1, "samples_per_sec": 1000.0 + step, "step_time_s": 0.01}
        if wall:
            record["time_s"] = step * 0.05
        if comm:
            record.update(comm_time_s=0.002, compute_time_s=0.008, wire_bytes=2048.0,
                          dense_bytes=8192.0, cpu_percent_rank0=90.0, cpu_percent_rank1=80.0,
                          rss_mb_rank0=400.0, rss_mb_rank1=390.0)
            if step == 30:
                record["events"] = [{"event": "straggler", "rank": 1, "factor": 2.0, "logs": 3}]
        for stage in range(stages):
            record.update({f"stage_compute_s_stage{stage}": 0.01 * (stage + 1),
                           f"stage_wait_s_stage{stage}": 0.005, f"stage_rss_mb_stage{stage}": 500.0,
                           "bubble_fraction": 0.3})
        if step % 20 == 0:
            record.update(eval_loss=1.0 / step, eval_accuracy=0.5 + step / 100)
        records.append(record)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "config.yaml").write_text(yaml.safe_dump({"name": name, "framework": framework}))
    if summary:
        (path / "summary.json").write_text(json.dumps({
            "name": name, "framework": framework, "world_size": 2, "steps": 40,
            "samples_per_sec": 1234.56, "wall_time_s": 12.345, "final": {"eval_accuracy": 0.9},
            "compression": name, **({"compression_ratio": 4.0} if comm else {})}))
    return path


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG, checking its signature; they sit in the IHDR chunk."""
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def table(md: str) -> list[list[str]]:
    rows = [line.strip("|").split("|") for line in md.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row] for row in rows[2:]]  # past the header and rule


def test_two_runs_overlaid_with_plots_and_table(tmp_path):
    a = make_run(tmp_path / "a", "fp16", "torch", comm=True)
    b = make_run(tmp_path / "b", "none", "tensorflow")
    md_path = report([a, b])
    out = a / "report"
    assert md_path == out / "report.md"
    names = {p.name for p in out.glob("*.png")}
    # No run logged GPU metrics: that plot is skipped, the others are written.
    assert names == {"loss.png", "accuracy.png", "throughput.png", "eval_accuracy.png",
                     "comm_compute.png", "step_time.png", "bytes.png", "system.png"}
    assert png_size(out / "loss.png")[0] == 2 * png_size(out / "throughput.png")[0]  # step + time
    assert png_size(out / "system.png")[0] == 2 * png_size(out / "bytes.png")[0]  # CPU + memory
    md = md_path.read_text()
    assert table(md) == [
        ["fp16", "torch", "fp16", "2", "40", "0.9000", "1235", "12.3", "2.00", "2.0", "4.0", "1"],
        ["none", "tensorflow", "none", "2", "40", "0.9000", "1235", "12.3", "-", "-", "-", "-"]]
    assert "![loss](loss.png)" in md and "gpu" not in md


def test_missing_metrics_and_summary_are_skipped(tmp_path):
    c = make_run(tmp_path / "c", "old", "torch", summary=False, wall=False)
    report([c], tmp_path / "out")
    out = tmp_path / "out"
    assert png_size(out / "loss.png")[0] == png_size(out / "throughput.png")[0]  # no time panel
    assert not (tmp_path / "out" / "comm_compute.png").exists()
    assert not (tmp_path / "out" / "system.png").exists()
    # Without summary.json: steps and accuracy come from the metrics, the rest is unknown.
    assert table((tmp_path / "out" / "report.md").read_text()) == [
        ["old", "torch", "-", "-", "40", "0.9000", "-", "-", "-", "-", "-", "-"]]


def test_pipeline_runs_get_the_stage_plot(tmp_path):
    run = make_run(tmp_path / "p", "pipe", "torch", stages=2)
    report([run])
    out = run / "report"
    # compute, wait, memory and bubble side by side
    assert png_size(out / "stages.png")[0] == 4 * png_size(out / "throughput.png")[0]
    assert "![stages](stages.png)" in (out / "report.md").read_text()
    report([make_run(tmp_path / "q", "flat", "torch")])
    assert not (tmp_path / "q" / "report" / "stages.png").exists()


def test_runs_with_the_same_name_are_told_apart(tmp_path):
    report([make_run(tmp_path / "x1", "same", "torch"), make_run(tmp_path / "x2", "same", "torch")])
    assert [row[0] for row in table((tmp_path / "x1" / "report" / "report.md").read_text())] == [
        "same (x1)", "same (x2)"]


def test_cli_writes_the_report(tmp_path, capsys):
    a = make_run(tmp_path / "a", "a", "torch")
    assert main(["report", str(a), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "accuracy.png").exists()
    assert "report written to" in capsys.readouterr().out


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "is not a directory"),
    (lambda p: p.mkdir(), "holds no metrics.jsonl"),
    # A damaged line before the last (a last line cut short is dropped:
    # tests/unit/test_metrics_file_errors.py).
    (lambda p: (p.mkdir(), (p / "metrics.jsonl").write_text('{"step": 1}\n{"st\n{"step": 3}\n')),
     "metrics.jsonl:2: not a JSON"),
])
def test_bad_run_directories_are_one_line_errors(tmp_path, capsys, setup, message):
    run = tmp_path / "run"
    setup(run)
    with pytest.raises(HvdtrainError, match=message):
        report([run])
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hvdtrain: error: ") and message in err and err.count("\n") == 1
