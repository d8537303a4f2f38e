"""The dashboards' writer process (:mod:`hvdtrain.observe.writer`): order, draining, errors, signals, and a
parent that dies; with a real child process and a recording sink built in it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdtrain.errors import HvdtrainError
from hvdtrain.observe.writer import SinkProcess

TARGET = "tests.unit.recording_sink:RecordingSink"


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_arrive_in_order_and_close_drains_them_in_the_idle_class(tmp_path):
    path = tmp_path / "seen.jsonl"
    sink = SinkProcess([(TARGET, {"path": str(path), "delay_s": 0.002})])
    for step in range(100):
        sink.log({"step": step, "loss": 1.0 / (step + 1), "events": [{"event": "x"}]})
        if step == 10:  # the job's signals are the parent's business: the child carries on
            pid = read(path)[0]["pid"]
            for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
                os.kill(pid, signum)
    sink.summary({"steps": 100})
    sink.close()  # returns only once the child has written everything and closed its sink
    items = read(path)
    assert items[0]["policy"] == getattr(os, "SCHED_IDLE", 5)
    assert [i["step"] for i in items[1:101]] == list(range(100))
    assert items[1]["events"] == [{"event": "x"}]
    assert items[101:] == [{"summary": {"steps": 100}}, {"closed": True}]


def test_a_sink_that_cannot_start_fails_the_constructor_with_its_reason(tmp_path):
    with pytest.raises(HvdtrainError, match="OSError: cannot open the event file"):
        SinkProcess([(TARGET, {"path": str(tmp_path / "x"), "fail_open": True})])
    with pytest.raises(HvdtrainError, match="cannot import 'no_such_module'"):
        SinkProcess([("no_such_module:Sink", {})])
    with pytest.raises(HvdtrainError, match="unknown sink 'tb'; known: console, jsonl, tensorboard"):
        SinkProcess([("tb", {})])  # the child builds sinks by their names in registry.SINKS


def test_a_sink_error_is_raised_by_a_later_call_and_by_close(tmp_path):
    path = tmp_path / "seen.jsonl"
    sink = SinkProcess([(TARGET, {"path": str(path), "fail_at": 3})])
    with pytest.raises(HvdtrainError, match="OSError: disk full"):
        for step in range(1000):
            sink.log({"step": step})
            time.sleep(0.001)
    assert step < 1000
    sink.close()  # the error was raised once; closing after it reports nothing new
    assert [i.get("step") for i in read(path)[1:]] == [0, 1, 2, None]  # and the sink was closed

    quiet = SinkProcess([(TARGET, {"path": str(tmp_path / "b.jsonl"), "fail_at": 0})])
    quiet.log({"step": 0})
    with pytest.raises(HvdtrainError, match="disk full"):
        quiet.close()


def test_a_dead_child_is_reported(tmp_path):
    sink = SinkProcess([(TARGET, {"path": str(tmp_path / "seen.jsonl")})])
    sink.log({"step": 0})
    os.kill(read(tmp_path / "seen.jsonl")[0]["pid"], signal.SIGKILL)
    with pytest.raises(HvdtrainError, match="ended early"):
        for step in range(1, 1000):
            sink.log({"step": step})
            time.sleep(0.01)


def test_the_child_finishes_its_records_when_the_parent_is_killed(tmp_path):
    path = tmp_path / "seen.jsonl"
    parent = (
        "import os, signal\n"
        "from hvdtrain.observe.writer import SinkProcess\n"
        f"sink = SinkProcess([({TARGET!r}, {{'path': {str(path)!r}, 'delay_s': 0.01}})])\n"
        "for step in range(50):\n"
        "    sink.log({'step': step})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    run = subprocess.run([sys.executable, "-c", parent], cwd=Path(__file__).parents[2])
    assert run.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and read(path)[-1] != {"closed": True}:
        time.sleep(0.1)
    assert [i["step"] for i in read(path)[1:-1]] == list(range(50))
