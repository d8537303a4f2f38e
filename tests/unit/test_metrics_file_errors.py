"""``metrics.jsonl`` when the disk fails under it: the write becomes one line naming the file (exit
74), and a last record cut short is left out by every reader (a resume's trim, ``hvdtrain report``)
rather than failing it. The run that fills a real disk is in tests/torch/test_failures.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hvdtrain.cli import main
from hvdtrain.errors import EnvironmentFailure, HvdtrainError
from hvdtrain.observe.sinks import JsonlSink
from hvdtrain.rundir import RunDir, read_records

WHOLE = "".join(json.dumps({"step": step, "loss": 1.0 / step}) + "\n" for step in (1, 2, 3))
CUT = '{"step": 4, "lo'  # what a write stopped by a full disk, or a killed rank 0, leaves


def test_a_full_disk_under_metrics_is_one_environment_failure_naming_the_file():
    # Every write to /dev/full fails with ENOSPC, as one to a full disk does.
    sink = JsonlSink(Path("/dev/full"), every_s=3600)
    sink.log({"step": 1, "loss": 0.5})
    with pytest.raises(EnvironmentFailure) as caught:
        sink.flush()
    assert str(caught.value) == ("cannot write metrics '/dev/full': No space left on device (ENOSPC); "
                                 "free space (or fix the directory), then resubmit with "
                                 "checkpoint.resume=auto")
    sink.log({"step": 2, "loss": 0.4})
    sink.close()  # raised once: the loop has it and stops every rank with it; nothing more written


def test_a_last_line_cut_short_is_left_out_and_a_damaged_one_before_it_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(WHOLE + CUT)
    assert [r["step"] for r in read_records(path)] == [1, 2, 3]
    path.write_text(WHOLE + "[1, 2]")  # parses, but is no record: not a write cut short
    with pytest.raises(HvdtrainError, match=r"metrics.jsonl:4: not a JSON object"):
        read_records(path)
    path.write_text(CUT + "\n" + WHOLE)
    with pytest.raises(HvdtrainError, match=r"metrics.jsonl:1: not a JSON object; the file is damaged"):
        read_records(path)


def test_resume_trims_a_file_that_ends_in_half_a_record(tmp_path):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.metrics.write_text(WHOLE + CUT)
    run.trim_metrics(2)
    assert run.metrics.read_text() == "".join(WHOLE.splitlines(keepends=True)[:2])


def test_report_plots_a_run_whose_last_record_was_cut_short(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(WHOLE + CUT)
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "loss.png").exists()



def test_the_slurm_stop_estimate_reads_past_a_last_record_cut_short(tmp_path):
    from hvdtrain.config import load_config
    from hvdtrain.slurm import BASE_STOP_S, stop_time_estimate

    cfg = load_config(Path(__file__).parents[2] / "configs" / "digits_torch.yaml",
                      [f"log.dir={tmp_path}", "log.every_steps=10"])
    RunDir(tmp_path).metrics.write_text(json.dumps({"step": 1, "step_time_s": 0.5}) + "\n" + CUT)
    assert stop_time_estimate(cfg) == pytest.approx(BASE_STOP_S + 10 * 0.5)


def test_a_trim_keeps_the_file_the_sink_appends_to(tmp_path):
    # An elastic reset trims metrics.jsonl while rank 0's sink keeps it open: the records logged
    # after the reset must land in the trimmed file, after the kept ones.
    run = RunDir(tmp_path)
    sink = JsonlSink(run.metrics)
    for step in (1, 2, 3):
        sink.log({"step": step})
    run.trim_metrics(2)
    sink.restart(2, 10)
    sink.log({"step": 3, "again": True})
    sink.close()
    assert read_records(run.metrics) == [{"step": 1}, {"step": 2}, {"step": 3, "again": True}]
