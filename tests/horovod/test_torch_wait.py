"""The patched Horovod's torch wait (patches/0008) and idle wait (patches/0010) at 2 ranks."""

import json
import subprocess
import sys

from tests.horovod import BIN, ROOT, horovodrun, rank_records

TIMELINE = ROOT / "docs" / "investigations" / "step-overhead" / "timeline.py"
sys.path.insert(0, str(TIMELINE.parent))
import timeline as timeline_script  # noqa: E402


def test_torch_synchronize_blocks_instead_of_spinning(tmp_path):
    # patches/0008: while rank 1 pauses before its allreduce, rank 0's thread waits in
    # hvd.synchronize. Spinning on sched_yield (Horovod's own wait) uses about as much CPU as the
    # wait lasts; blocking uses next to none.
    timeline = tmp_path / "timeline.json"
    proc = horovodrun(str(BIN / "python"), "tests/horovod/torch_wait_worker.py", timeout=300,
                      env={"HOROVOD_TIMELINE": str(timeline), "HOROVOD_TIMELINE_MARK_CYCLES": "1",
                           "HOROVOD_CYCLE_TIME": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = {r["rank"]: r for r in rank_records(proc.stdout)}
    assert records[0]["result"] == records[1]["result"] == [3.0] * 4
    assert records[0]["quick_ok"] and records[1]["quick_ok"]
    waited = records[0]
    assert waited["wait_s"] > 1.0, waited  # rank 0 did wait for rank 1
    assert waited["wait_cpu_s"] < 0.25 * waited["wait_s"], waited

    # The same job's Horovod timeline, read by the step-overhead investigation's profiling script:
    # the late allreduce and the 200 quick ones were executed by Gloo (each once per tensor name).
    table = subprocess.run([sys.executable, str(TIMELINE), str(timeline), "--steps", "201"],
                           capture_output=True, text=True, check=True)
    rows = {line[:32].strip(): line.split()[-2:] for line in table.stdout.splitlines()[1:]}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "GLOO_ALLREDUCE"} <= rows.keys(), table.stdout
    assert 0 < float(rows["GLOO_ALLREDUCE"][0]) <= float(rows["ALLREDUCE"][0])

    # patches/0010: while rank 1 pauses it has nothing queued or pending, so its background thread
    # waits for a submission (50 ms at most at a time) instead of negotiating every 1 ms cycle, and
    # rank 0's cycles, each a negotiation with rank 1, follow. Unpatched: about one cycle per
    # millisecond of the pause on rank 0 (the timeline's writer).
    events = json.loads(timeline.read_text())
    negotiations = timeline_script.spans(events)["NEGOTIATE_ALLREDUCE"]
    start, end = max(negotiations, key=lambda span: span[1] - span[0])  # the late allreduce's
    cycles = sum(1 for e in events
                 if e.get("name") == "CYCLE_START" and start <= float(e["ts"]) <= end)
    assert (end - start) / 1e6 > 1.0 and 0 < cycles < 200, (end - start, cycles)
