"""TensorBoard and W&B sinks of a real one-process PyTorch run, read back with each format's reader."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hvdtrain.driver import train
from tests.conftest import CONFIG, ROOT, quiet_config, read_jsonl

FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # W&B keys are 40 characters


def read_wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` transaction log, decoded with the ``wandb`` package's protobufs.

    wandb 0.31 has no Python reader for its own files any more (its Go core reads them), so this is
    the documented LevelDB log layout: a 7-byte file header, then 32 KiB blocks of records, each with a
    7-byte header (crc32, length, type) and full (1) or first/middle/last (2/3/4) fragments.
    """
    from wandb.proto import wandb_internal_pb2

    data, pos, block, fragment, records = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is zero padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        fragment += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(fragment))
            fragment = b""
    return records


def wandb_contents(run_dir: Path) -> tuple[str, dict, dict[int, dict], dict]:
    """(run id, config, history by step, summary) of the single offline run under ``run_dir``."""
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    run_id, config, history, summary = "", {}, {}, {}
    for record in read_wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                   for i in record.history.item}
            history[row["_step"]] = row
        elif kind == "summary":
            for u in record.summary.update:
                summary["/".join(u.nested_key) or u.key] = json.loads(u.value_json)
    return run_id, config, history, summary


@pytest.fixture(scope="module")
def sink_run(tmp_path_factory):
    """One two-epoch run with TensorBoard and offline W&B on, and a W&B key in the environment."""
    tmp = tmp_path_factory.mktemp("sinks")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_API_KEY", FAKE_KEY)
        cfg = quiet_config(CONFIG, tmp, "train.epochs=2", "log.tensorboard=true", "log.wandb=offline",
                           "log.dashboard_every_s=0", "checkpoint.every_steps=0")
        train(cfg)
    return cfg, tmp / "run", read_jsonl(tmp / "run" / "metrics.jsonl")


def event_accumulator(logdir: Path):
    """TensorBoard's own event reader, on its TensorFlow-free stub.

    Without the ``tensorboard.compat.notf`` marker (TensorBoard's switch for builds without
    TensorFlow) the reader imports TensorFlow into this PyTorch process: 13 s, and it sets
    environment variables.
    """
    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return events


def test_tensorboard_events_hold_every_logged_scalar(sink_run):
    _, run_dir, records = sink_run
    events = event_accumulator(run_dir / "tensorboard")
    assert {"train/loss", "train/accuracy", "train/time_s", "eval/accuracy",
            "eval/loss"} <= set(events.Tags()["scalars"])
    for tag, key in (("train/loss", "loss"), ("train/samples_per_sec", "samples_per_sec"),
                     ("eval/accuracy", "eval_accuracy")):
        logged = [(r["step"], r[key]) for r in records if key in r]
        scalars = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in scalars] == [s for s, _ in logged] and len(logged) >= 2
        assert [v for _, v in scalars] == pytest.approx([v for _, v in logged], rel=1e-6)  # float32


def test_wandb_offline_run_holds_config_metrics_and_summary(sink_run):
    cfg, run_dir, records = sink_run
    run_id, config, history, summary = wandb_contents(run_dir)
    assert (run_dir / "wandb_id").read_text().strip() == run_id and len(run_id) == 8
    assert {k: v for k, v in config.items() if k != "_wandb"} == cfg.to_dict()
    assert sorted(history) == [r["step"] for r in records]
    for record in records:
        assert history[record["step"]]["train/loss"] == pytest.approx(record["loss"])
    final = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == final["steps"] == 90
    assert summary["final"] == pytest.approx(final["final"]) and "eval_accuracy" in final["final"]


def test_api_key_leaves_no_trace_in_the_run_directory(sink_run):
    _, run_dir, _ = sink_run
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert len(files) > 5
    assert [p for p in files if FAKE_KEY.encode() in p.read_bytes()] == []


def test_the_wandb_sink_keeps_w_and_b_error_reporting_off_unless_asked(tmp_path):
    # It would load OpenTelemetry on the first log call, in the first second of training.
    script = ("import sys; from hvdtrain.observe.sinks import WandbSink; "
              f"s = WandbSink({str(tmp_path)!r}, mode='offline', project='p', name='n', config={{}}); "
              "s.log({'step': 1, 'loss': 1.0}); s.close(); print('opentelemetry.sdk' in sys.modules)")
    for setting, loaded in ((None, "False"), ("true", "True")):
        env = {k: v for k, v in os.environ.items() if k != "WANDB_ERROR_REPORTING"}
        env.update({"WANDB_ERROR_REPORTING": setting} if setting else {})
        proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split()[-1] == loaded


def test_a_new_run_in_the_directory_gets_a_new_wandb_id(tmp_path):
    first = quiet_config(CONFIG, tmp_path, "train.max_steps=5", "log.wandb=offline",
                         "log.tensorboard=false")
    train(first)
    old = (tmp_path / "run" / "wandb_id").read_text()
    train(quiet_config(CONFIG, tmp_path, "train.max_steps=5", "log.wandb=offline", "log.overwrite=true",
                       "log.tensorboard=false"))
    new = (tmp_path / "run" / "wandb_id").read_text()
    assert new != old
    assert sorted(p.name.rsplit("-", 1)[1] for p in (tmp_path / "run").glob("wandb/offline-run-*")) == \
        sorted([old.strip(), new.strip()])


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    common = ("log.wandb=offline", "log.tensorboard=true", "log.dashboard_every_s=0",
              "checkpoint.every_steps=0")
    train(quiet_config(CONFIG, tmp_path, "train.epochs=1", *common))
    first = (tmp_path / "run" / "wandb_id").read_text()
    train(quiet_config(CONFIG, tmp_path, "train.epochs=2", "checkpoint.resume=auto", *common))
    assert (tmp_path / "run" / "wandb_id").read_text() == first
    # offline-run-<date>_<time>-<id>, with "-1" appended when two runs start in the same second
    ids = {re.match(r"offline-run-\d{8}_\d{6}-([a-z0-9]+)", p.name).group(1)
           for p in (tmp_path / "run").glob("wandb/offline-run-*")}
    assert ids == {first.strip()}
    # The resumed run appends a second event file; together they hold each logged step once.
    events = event_accumulator(tmp_path / "run" / "tensorboard")
    steps = [e.step for e in events.Scalars("train/loss")]
    assert len(list((tmp_path / "run" / "tensorboard").iterdir())) == 2
    assert steps == [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]


def test_throttled_dashboards_get_the_first_record_evaluations_and_the_last_step(tmp_path):
    # An interval longer than the run: only the records that always go reach TensorBoard and W&B.
    train(quiet_config(CONFIG, tmp_path, "train.epochs=2", "log.tensorboard=true", "log.wandb=offline",
                       "log.dashboard_every_s=3600", "checkpoint.every_steps=0"))
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    kept = [records[0]["step"]] + [r["step"] for r in records[1:] if "eval_accuracy" in r]
    assert len(records) > 6 and len(kept) == 3 and kept[-1] == records[-1]["step"] == 90
    events = event_accumulator(tmp_path / "run" / "tensorboard")
    assert [e.step for e in events.Scalars("train/loss")] == kept
    assert sorted(wandb_contents(tmp_path / "run")[2]) == kept


def test_every_sink_can_be_switched_off(tmp_path, capsys):
    cfg = quiet_config(CONFIG, tmp_path, "train.max_steps=5", "log.jsonl=false",
                       "log.tensorboard=false", "log.system=false")
    result = train(cfg)
    names = {p.name for p in (tmp_path / "run").iterdir()}
    assert names == {"config.yaml", "summary.json", "checkpoints"}
    assert result.summary["steps"] == 5 and capsys.readouterr().out == ""
