"""The parameter servers' wire refuses what breaks the protocol (issue 55): every message a server
or a worker receives is checked for its size before a byte of it lands, and its fields for their
ranges, so that a malformed or hostile message ends the job with one line naming the sender's rank
and the field, with no garbage, no allocation sized by the peer and no hang.

One mpirun job (tests/unit/ps_wire_job.py: 2 workers and 1 server, each case on a communicator of
its own) sends the real server, and a real client, one broken message per case; last, through
``hvdtrain.driver.train`` as ``hvdtrain train`` serves, a broken HELLO ends the whole job.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.ps.codec import QSGD, Codec, TopK
from hvdtrain.ps.protocol import MAX_CHUNKS
from tests.conftest import run_env

JOB = str(Path(__file__).with_name("ps_wire_job.py"))
W0, W1, S0 = "worker 0 (rank 0 on host ", "worker 1 (rank 1 on host ", "parameter server 0 (rank 2 on host "

SERVER_CASES = {
    "hello_short": (W1, "sent HELLO of 24 bytes where 112 belong"),
    "hello_long": (W1, "sent HELLO of 800000 bytes where 112 belong"),
    "chunk_zero": (W1, "sent HELLO's chunk=0: must be >= 1"),
    "chunk_negative": (W1, "sent HELLO's chunk=-256: must be >= 1"),
    "wire_negative": (W1, "sent HELLO's wire=-1: must be 0 .. 1 (float32, float16)"),
    "consistency_out_of_range": (W1, "sent HELLO's consistency=3: must be 0 .. 2 (bsp, ssp, asp)"),
    "method_negative": (W1, "sent HELLO's method=-1: must be 0 .. 4"),
    "ratio_nan": (W1, "sent HELLO's ratio=nan: must be finite and in [0, 1]"),
    "total_negative": (W1, "sent HELLO's total=-1: must be >= 0"),
    "total_too_many_chunks": (W1, f"sent HELLO's total={2**40}: {2**40} chunks of 1 elements, "
                                  f"more than the {MAX_CHUNKS} a server lays out"),
    "total_disagrees": (W1, f"sent HELLO's total={2**45} where {W0}"),
    "total_huge": (W0, f"sent HELLO's total={2**45} (as every worker did): this server's shard "
                       f"of {2**45} elements needs up to 1572864.0 GiB, the machine has "),
    "control_unknown_op": (W1, "sent CONTROL's operation=99: unknown (known: 1 PUSH, 2 DONE, "
                               "3 STATE, 4 LOAD)"),
    "control_negative_step": (W1, "sent CONTROL's step=-5: must be >= 0"),
    "control_other_step": (W1, "sent CONTROL's step=3: the workers are at step 0"),
    "push_short": (W1, "sent PUSH of chunk 5 of 504 bytes where 508 belong"),
    "push_long": (W1, "sent PUSH of chunk 5 of 800000 bytes where 508 belong"),
    "push_index_negative": (W1, "sent PUSH of chunk 4 with index -1 outside [0, 256)"),
    "init_optimizer_negative": (W0, "sent INIT's optimizer=-1.0: must be 0 .. 2 (sgd, adam, adamw)"),
    "init_arrays_huge": (W0, f"sent INIT's arrays={2**40}: must be 0 (sgd keeps 0 state vectors)"),
    "async_unknown_op": (W1, "sent CONTROL's operation=99: unknown to asp servers"),
    "async_load_op": (W1, "sent CONTROL's operation=4: unknown to asp servers"),
    "async_version_ahead": (W1, "sent CONTROL's version=7: this server is at version 0"),
    "async_lr_nan": (W1, "sent CONTROL's lr=nan: must be finite and in [0, inf]"),
}
"""Per case of the job: whose name the server's error starts with, and what it says then."""

CLIENT_CASES = {
    "pull_short": "sent PULL of chunk 5 of 504 bytes where 508 belong",
    "pull_index_negative": "sent PULL of chunk 4 with index -1 outside [0, 256)",
}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("wire")
    cmd = ["mpirun", "-np", "3", "--oversubscribe", sys.executable, JOB, str(out)]
    # No hang: every case must end at once; the slack is for a busy machine only.
    proc = subprocess.run(cmd, env=run_env(), capture_output=True, text=True, timeout=240)
    return proc, out


def records(out: Path, rank: int) -> dict:
    path = out / f"rank{rank}.json"
    assert path.exists(), f"rank {rank} wrote nothing: the cases did not all end"
    return json.loads(path.read_text())


@pytest.mark.parametrize("case", sorted(SERVER_CASES))
def test_the_server_refuses_a_broken_message_naming_the_sender_and_the_field(job, case):
    proc, out = job
    got = records(out, 2).get(case)
    assert got is not None, proc.stderr[-3000:]
    assert got.get("type") == "ProtocolError", got  # refused, not served, not another failure
    sender, says = SERVER_CASES[case]
    message = got["error"]
    assert message.startswith(sender) and "\n" not in message, message
    assert says in message, message


def test_a_worker_refuses_a_chunk_size_that_servers_would_refuse_before_it_sends(job):
    _, out = job
    got = records(out, 0).get("client_too_many_chunks")
    assert got == {"type": "HvdtrainError", "error": (
        f"ps.chunk_kib: the {2**30}-element gradient would travel in {2**22} chunks of 256 "
        f"elements, more than the {MAX_CHUNKS} a server lays out: raise ps.chunk_kib")}, got


@pytest.mark.parametrize("case", sorted(CLIENT_CASES))
def test_a_worker_refuses_a_broken_answer_naming_the_server_and_the_field(job, case):
    proc, out = job
    got = records(out, 0).get(case)
    assert got is not None, proc.stderr[-3000:]
    assert got.get("type") == "ProtocolError", got
    assert got["error"].startswith(S0) and "\n" not in got["error"], got
    assert CLIENT_CASES[case] in got["error"], got


def test_a_broken_hello_ends_the_job_with_one_line_from_the_server(job):
    """As ``hvdtrain train`` serves: the server prints one line naming itself, the sender and the
    field, and aborts the job (its exit code 1), rather than dividing by a chunk of 0."""
    proc, _ = job
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hvdtrain: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"hvdtrain: error: {S0}"), lines[0]
    assert f"failed: ProtocolError: {W1}" in lines[0], lines[0]
    assert "sent HELLO's chunk=0: must be >= 1; ending the job" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and "ZeroDivisionError" not in proc.stderr


@pytest.mark.parametrize(("codec", "buffers", "problem"), [
    (TopK(0.1), [np.ones(3, np.float32), np.array([0, 9, 10], np.int32)], "index 10 outside [0, 10)"),
    (TopK(0.1), [np.ones(2, np.float32), np.array([-3, 2], np.int32)], "index -3 outside [0, 10)"),
    (TopK(0.1), [np.ones(2, np.float32), np.array([0, 9], np.int32)], None),
    (QSGD(4, 0), [np.array([127, -128, 0], np.int8), np.ones(1, np.float32)],
     "code -128 outside [-127, 127]"),
    (QSGD(4, 0), [np.array([127, -127, 0], np.int8), np.ones(1, np.float32)], None),
    (Codec("float16"), [np.full(10, np.nan, np.float16)], None),  # values are the training's
])
def test_codecs_name_what_no_encoder_sends(codec, buffers, problem):
    assert codec.problem(buffers, 10) == problem
