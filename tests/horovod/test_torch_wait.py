"""The patched Horovod's torch wait (patches/0008) at 2 ranks."""

import subprocess
import sys

from tests.horovod import BIN, ROOT, horovodrun, rank_records


def test_torch_synchronize_blocks_instead_of_spinning(tmp_path):
    # patches/0008: while rank 1 pauses before its allreduce, rank 0's thread waits in
    # hvd.synchronize. Spinning on sched_yield (Horovod's own wait) uses about as much CPU as the
    # wait lasts; blocking uses next to none.
    timeline = tmp_path / "timeline.json"
    proc = horovodrun(str(BIN / "python"), "tests/horovod/torch_wait_worker.py", timeout=300,
                      env={"HOROVOD_TIMELINE": str(timeline)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = {r["rank"]: r for r in rank_records(proc.stdout)}
    assert records[0]["result"] == records[1]["result"] == [3.0] * 4
    assert records[0]["quick_ok"] and records[1]["quick_ok"]
    waited = records[0]
    assert waited["wait_s"] > 1.0, waited  # rank 0 did wait for rank 1
    assert waited["wait_cpu_s"] < 0.25 * waited["wait_s"], waited

    # The same job's Horovod timeline, read by the profiling script of scripts/bench: the late
    # allreduce and the 200 quick ones were executed by Gloo (each once per tensor name).
    table = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "timeline.py"),
                            str(timeline), "--steps", "201"], capture_output=True, text=True, check=True)
    rows = {line[:32].strip(): line.split()[-2:] for line in table.stdout.splitlines()[1:]}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "GLOO_ALLREDUCE"} <= rows.keys(), table.stdout
    assert 0 < float(rows["GLOO_ALLREDUCE"][0]) <= float(rows["ALLREDUCE"][0])
