"""The parameter server without a framework: layout, config errors, and real jobs under mpirun
(servers through ``hvdtrain.driver.train``, workers on the real client; no Horovod)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.config import load_config
from hvdtrain.errors import ConfigError
from hvdtrain.ps.layout import ChunkLayout, chunk_elements, owner, travel_order
from tests.conftest import run_env

JOB = str(Path(__file__).with_name("ps_job.py"))


def test_chunks_cover_the_vector_once_and_spread_by_hash():
    layout = ChunkLayout(9610, chunk_elements(8), 2)  # the digits MLP in 8 KiB chunks
    assert layout.count == 5 and layout.bounds(4) == (8192, 9610)
    owned = [layout.owned(s) for s in range(2)]
    assert sorted(owned[0] + owned[1]) == list(range(5)) and all(owned)
    assert layout.elements(0) + layout.elements(1) == 9610
    assert [owner(c, 3) for c in range(6)] == [owner(c, 3) for c in range(6)]  # no process salt
    assert ChunkLayout(0, 256, 1).count == 1 and ChunkLayout(0, 256, 1).bounds(0) == (0, 0)


@pytest.mark.parametrize("servers", [1, 3, 4])
def test_workers_push_round_robin_over_the_servers_in_each_servers_order(servers):
    layout = ChunkLayout(64 * 100, 100, servers)
    for first in range(servers):
        for descending in (True, False):
            order = travel_order(layout, first, descending)
            assert sorted(order) == list(range(64))
            for s in range(servers):  # what server s receives: its chunks, in its order
                assert [c for c in order if owner(c, servers) == s] == sorted(
                    layout.owned(s), reverse=descending)
            owners = [owner(c, servers) for c in order[:servers]]
            assert owners == [(first + t) % servers for t in range(servers)]


@pytest.mark.parametrize(("overrides", "message"), [
    (["ps.staleness=2"], "ps.staleness=2: only ps.consistency=ssp has a staleness bound"),
    (["comm.topology=ps", "ps.consistency=asp", "framework=tensorflow"],
     "ps.consistency='asp': the servers' optimizer serves PyTorch workers only"),
    (["comm.topology=ps", "ps.consistency=ssp", "train.precision=fp16"],
     "ps.consistency='ssp' with train.precision='fp16': a push is applied alone"),
    (["train.slow_ms=-1"], "train.slow_ms=-1"),
    (["comm.topology=ps", "elastic.enabled=true"], "comm.topology=ps: elastic mode cannot run"),
    (["comm.topology=ps", "comm.compression=powersgd"],
     "comm.compression='powersgd' with comm.topology=ps: PowerSGD's factors need two"),
    (["comm.topology=ps", "comm.compression=topk", "ps.consistency=asp"],
     "comm.compression='topk' with comm.topology=ps and ps.consistency='asp': the servers'"),
    (["shard.stage=1", "comm.compression=qsgd"],
     "comm.compression='qsgd' with shard.stage=1: the sharded update's reduce-scatter carries"),
    (["comm.topology=ps", "comm.compression=randomk", "comm.momentum_correction=true"],
     "comm.momentum_correction=true does nothing with comm.topology='ps'"),
    (["comm.topology=star"], "comm.topology='star': must be one of ring, ps"),
    (["ps.servers=0"], "ps.servers=0: must be >= 1"),
])
def test_impossible_combinations_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides, environ={})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_staleness_belongs_to_ssp_and_the_ring_reads_no_ps_key():
    cfg = load_config(None, ["comm.topology=ps", "ps.consistency=ssp", "ps.staleness=1"],
                      environ={})
    assert cfg.ps.staleness == 1
    with pytest.raises(ConfigError, match=r"^ps.consistency='ssp' and ps.staleness=1 do nothing "
                       r"with comm.topology='ring'"):
        load_config(None, ["ps.consistency=ssp", "ps.staleness=1"], environ={})


def mpirun(np_: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", sys.executable, JOB, *args]
    return subprocess.run(cmd, env=run_env(), capture_output=True, text=True, timeout=timeout)


def records(out: Path, ranks: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.parametrize(("workers", "servers", "compression"),
                         [(2, 1, "none"), (2, 2, "none"), (1, 1, "none"), (2, 2, "fp16")])
def test_servers_sum_every_chunk_and_import_no_framework(tmp_path, workers, servers, compression):
    proc = mpirun(workers + servers, "sum", str(tmp_path), str(servers), compression)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = records(tmp_path, workers + servers)
    assert [r["role"] for r in got] == ["worker"] * workers + ["server"] * servers
    for record in got:
        assert record["modules"] == [], record  # not torch, tensorflow, keras nor horovod
    for record in got[:workers]:
        assert record["errors"] == [0.0] * 4  # small integers: sums are exact
        assert record["pushed"] == record["pulled"] == 1407 * (2 if compression == "fp16" else 4)
        assert sum(record["owned"]) == 6 and all(record["owned"])
    assert [r["served"] for r in got[workers:]] == [4] * servers


def test_a_server_that_stops_answering_ends_the_job_with_its_name(tmp_path):
    proc = mpirun(3, "hang", str(tmp_path), "1", timeout=90)  # no hang: would time out here
    assert proc.returncode == 74, proc.stderr[-2000:]  # EnvironmentFailure's: resume later
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hvdtrain: error:")]
    assert lines, proc.stderr[-2000:]
    assert lines[0].startswith("hvdtrain: error: parameter server 0 (rank 2 on host ")
    assert "within ps.timeout_s=3 s at step 0: it died or hangs" in lines[0]


def test_a_server_killed_ends_the_job_and_mpirun_names_its_rank(tmp_path):
    proc = mpirun(3, "die", str(tmp_path), "1", timeout=90)
    assert proc.returncode != 0
    assert "process rank 2 with PID" in proc.stderr and "exited on signal 9" in proc.stderr


def test_workers_that_fail_before_their_first_message_end_the_job(tmp_path):
    """Without the driver's MPI_Abort at exit the workers would wait in MPI_Finalize for a server
    that waits for them: the job would hang."""
    proc = mpirun(3, "fail", str(tmp_path), "1", timeout=90)
    assert proc.returncode == 2, proc.stderr[-2000:]  # the CLI's code for a user error
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hvdtrain: error:")]
    assert lines and "'nope'" in lines[0], proc.stderr[-2000:]


def test_one_process_alone_has_no_worker_to_spare(tmp_path):
    """Without a launcher the job is one rank: a server would leave no worker."""
    code = ("from hvdtrain.config import load_config; from hvdtrain.driver import train; "
            f"train(load_config(None, ['comm.topology=ps', 'log.dir={tmp_path}'], environ={{}}))")
    proc = subprocess.run([sys.executable, "-c", code], env=run_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert ("HvdtrainError: ps.servers=1 with 1 rank(s) in the job leaves no worker: launch more "
            "ranks than servers (e.g. -np 2)") in proc.stderr, proc.stderr[-2000:]


COMPRESSED_BYTES = {"topk": 5 * 12 * 8 + 127 * 4, "randomk": 5 * 12 * 8 + 127 * 4,
                    "qsgd": 5 * (256 + 2 * 4) + 127 * 4}
"""Bytes each way per worker and step of ps_job.py's 1,407 elements in chunks of 256 (the last
127, under comm.min_size=256, dense float32): top-k and random-k at ratio 0.05 send 12 values and
12 int32 indices per chunk, qsgd a byte per element and a float32 scale per bucket of 128."""


@pytest.mark.parametrize("method", ["topk", "randomk"])
def test_compressed_pushes_and_pulls_lose_nothing_with_error_feedback(tmp_path, method):
    """2 workers + 2 servers, 4 steps: what the workers pulled plus every worker's and server's
    residual (fetched as for a checkpoint) is the sum of everything pushed."""
    proc = mpirun(4, "compress", str(tmp_path), "2", method, "4", "0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = records(tmp_path, 4)
    assert all(r["modules"] == [] for r in got)
    assert [r["served"] for r in got[2:]] == [4, 4]
    assert got[0]["lost"] < 1e-5
    for record in got[:2]:
        assert record["pushed"] == record["pulled"] == COMPRESSED_BYTES[method]
        stats = record["stats"]
        assert stats["wire_bytes"] == 2 * COMPRESSED_BYTES[method]
        assert stats["dense_bytes"] == 2 * 4 * 1407


@pytest.mark.parametrize("method", ["topk", "randomk", "qsgd"])
def test_compressed_state_resumes_on_another_number_of_servers(tmp_path, method):
    """A checkpoint entry gathered after step 2 with 1 server (step, push and pull residuals)
    continues with 2 servers to the very average the 1-server run pulled at step 4."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    proc = mpirun(3, "compress", str(one), "1", method, "4", "2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    proc = mpirun(4, "compress", str(two), "2", method, "4", "0", str(one / "state.npz"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert records(two, 4)[0]["first"] == 2 and [r["served"] for r in records(two, 4)[2:]] == [2, 2]
    assert records(one, 3)[0]["pushed"] == COMPRESSED_BYTES[method]
    assert np.array_equal(np.load(two / "last.npy"), np.load(one / "last.npy"))
    with np.load(one / "state.npz") as entry:
        assert int(entry["step"]) == 2 and str(entry["method"]) == method
        assert ("ps_server_residual" in entry.files) == (method == "topk")
        assert ("residual/0" in entry.files) == (method != "qsgd")
