"""Parameter servers (``comm.topology=ps``, dedicated, ``bsp``) under ``horovodrun --mpi``: the
servers sum, the workers keep their optimizers, so training equals the ring's.

Per framework, up to three launches of the equivalence run of test_engines.py (5 epochs, 2
micro-batches per step): 2 workers + 1 server (-np 3), 2 workers + 2 servers (-np 4, the 9,610
parameters of the MLP in 8 KiB chunks: 5 chunks, 2 on one server and 3 on the other), and
1 worker + 1 server at twice the batch (-np 2). They are compared with the ring's runs of the same
workers, which test_engines.py launches anyway. The -np 3 launch also runs fp16, top-k at 5% and
qsgd on the wire, whose accuracy is held to the uncompressed ps run's; the -np 4 launch resumes
the -np 3 launch's step-100 checkpoints of the uncompressed and top-k runs on 2 servers.

Every check runs once by default, in one framework, so that the default run needs four launches
(PyTorch: -np 3 and -np 4; TensorFlow: -np 3 and -np 2) and both frameworks are shown equal to the
ring; the same check in the other framework is marked ``long`` (``make test-long``). The tests
are ordered so that none starts more than two launches (pytest-timeout's 600 s is per test).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.checkpoint import verify
from tests.conftest import (
    BIN,
    assert_accuracy_near,
    assert_loss_near,
    horovodrun,
    read_jsonl,
    run_env,
)
from tests.multirank.conftest import CONFIGS, EQUIV, Launch, launch_worker
from tests.multirank.test_stop_resume import pid_of_rank


def frameworks(default: str) -> pytest.MarkDecorator:
    """Both frameworks, the one that is not ``default`` marked ``long``."""
    return pytest.mark.parametrize("framework", [
        name if name == default else pytest.param(name, marks=pytest.mark.long)
        for name in ("torch", "tensorflow")])


PS = "comm.topology=ps,ps.servers={s},ps.chunk_kib=8"
PARAMETERS = 64 * 128 + 128 + 128 * 10 + 10
"""The digits MLP's parameters (hidden layer of 128)."""
TOPK = "comm.compression=topk,comm.ratio=0.05,comm.min_size=0"
CHUNKS = (2048, 2048, 2048, 2048, 1418)
"""The MLP's flat gradient in chunks of 8 KiB."""
TOLERANCE = 1e-5
"""As test_engines.py's -np 2 against -np 1: float32 rounding compounded over 115 steps (the ps
sums may add in another order than the ring), where one step more or less moves 1e-3 to 1e-2."""


@pytest.fixture(scope="session")
def ps_launch(tmp_path_factory) -> Callable[[str, int, int], Launch]:
    """``ps_launch(framework, workers, servers)``: the equivalence run with ``servers`` dedicated
    servers after ``workers`` workers (batch 32 / workers), launched once and shared."""
    cache: dict[tuple[str, int, int], Launch] = {}

    def get(framework: str, workers: int, servers: int) -> Launch:
        key = (framework, workers, servers)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ps-{framework}-{workers}w{servers}s")
            run = EQUIV.format(b=32 // workers, lr=0.1 / workers) + "," + PS.format(s=servers)
            runs = [f"ps:{run}"]
            if (workers, servers) == (2, 1):
                runs += [f"fp16:{run},comm.compression=fp16", f"topk:{run},{TOPK}",
                         f"qsgd:{run},comm.compression=qsgd"]
            if (workers, servers) == (2, 2):  # continue the 1-server runs' step-100 checkpoints
                for name, extra in (("ps", ""), ("topk", f",{TOPK}")):
                    saved = get(framework, 2, 1).out / name / "checkpoints" / "step-00000100.ckpt"
                    runs.append(f"{name}_resumed:{run},checkpoint.resume={saved}{extra}")
            cache[key] = launch_worker(workers + servers, "mpi", framework, out, runs)
        return cache[key]

    return get


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str,
                atol: float = TOLERANCE) -> None:
    assert got.keys() == want.keys() and len(got) == 4, what
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=atol, rtol=0, err_msg=f"{what}: {key}")


@frameworks("torch")
def test_workers_write_and_count_bytes_each_way(ps_launch, framework):
    launch = ps_launch(framework, 2, 2)
    summary = launch.summary("ps")
    assert summary["world_size"] == 2  # the workers: servers are not in Horovod's world
    assert summary["topology"] == "ps" and summary["ps_servers"] == 2
    assert summary["steps"] == 5 * 23 and summary["final"]["eval_accuracy"] > 0.9
    assert len(summary["hosts"]) == 2
    records = read_jsonl(launch.out / "ps" / "metrics.jsonl")
    # Per step and worker: the whole float32 gradient pushed, and its sum pulled.
    logged = [r for r in records if "wire_bytes" in r]
    assert logged and {r["wire_bytes"] for r in logged} == {2 * 4 * PARAMETERS}
    assert {(r["push_bytes"], r["pull_bytes"]) for r in logged} == {(4 * PARAMETERS,) * 2}
    for rank in (0, 1):
        _, record = launch.rank("ps", rank)
        assert record["summary"]["final"] == summary["final"]


@frameworks("torch")
def test_a_checkpoint_resumes_with_another_number_of_servers(ps_launch, framework):
    """With bsp the servers hold no state: a 1-server run's checkpoint continues on 2 servers to
    the very parameters the 1-server run ended with."""
    resumed, _ = ps_launch(framework, 2, 2).rank("ps_resumed", 0)
    whole, _ = ps_launch(framework, 2, 1).rank("ps", 0)
    for key in whole:
        assert np.array_equal(resumed[key], whole[key]), key


@pytest.mark.parametrize(("framework", "servers"), [
    ("torch", 2), ("tensorflow", 1),
    pytest.param("torch", 1, marks=pytest.mark.long),
    pytest.param("tensorflow", 2, marks=pytest.mark.long)])
def test_two_workers_equal_the_ring(ps_launch, two_ranks, framework, servers):
    launch = ps_launch(framework, 2, servers)
    p0, _ = launch.rank("ps", 0)
    p1, _ = launch.rank("ps", 1)
    for key in p0:  # every worker pulls the same sums: the same bits
        assert np.array_equal(p0[key], p1[key]), key
    ring, _ = two_ranks(framework, "mpi").rank("equiv", 0)
    assert_same(p0, ring, f"{servers} server(s) against the ring")
    assert not (launch.out / "ps" / "rank2.npz").exists()  # a server trains nothing


@frameworks("tensorflow")
def test_one_worker_equals_two_at_half_the_batch(ps_launch, one_rank_equiv, framework):
    """-np 2 == -np 1 at double the batch, under ps: 2 workers + 1 server against 1 worker +
    1 server, and the latter against one rank with no server at all."""
    one, _ = ps_launch(framework, 1, 1).rank("ps", 0)
    two, _ = ps_launch(framework, 2, 1).rank("ps", 0)
    assert_same(two, one, "2 workers against 1 worker")
    alone, _ = one_rank_equiv(framework).rank("one", 0)
    assert_same(one, alone, "1 worker + 1 server against 1 rank", atol=0.0)


@frameworks("tensorflow")
def test_fp16_on_the_wire_halves_the_bytes_and_stays_near(ps_launch, framework):
    launch = ps_launch(framework, 2, 1)
    fp16, fp32 = launch.summary("fp16")["final"], launch.summary("ps")["final"]
    assert_accuracy_near(fp16["eval_accuracy"], fp32["eval_accuracy"], "ps with fp16")
    assert_loss_near(fp16["eval_loss"], fp32["eval_loss"], "ps with fp16")
    logged = [r for r in read_jsonl(launch.out / "fp16" / "metrics.jsonl") if "wire_bytes" in r]
    assert logged and {(r["push_bytes"], r["pull_bytes"]) for r in logged} == {(2 * PARAMETERS,) * 2}
    assert {r["compression_ratio"] for r in logged} == {2.0}


def test_cli_servers_exit_zero_and_rank_zero_reports(tmp_path):
    proc = horovodrun(3, "mpi", [str(BIN / "hvdtrain"),
                                 "train", str(CONFIGS["torch"]), "train.epochs=1",
                                 f"log.dir={tmp_path}", "log.wandb=disabled",
                                 "comm.topology=ps"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("[hvdtrain] done: 23 steps on 2 rank(s)") == 1


def test_dedicated_servers_refuse_the_gloo_controller(tmp_path):
    proc = horovodrun(2, "gloo", [str(BIN / "hvdtrain"),
                                  "train", str(CONFIGS["torch"]), f"log.dir={tmp_path}",
                                  "comm.topology=ps"], timeout=600)
    assert proc.returncode != 0
    assert ("hvdtrain: error: comm.topology=ps with ps.placement=dedicated needs MPI between "
            "workers and servers: launch with horovodrun --mpi") in proc.stderr


def assert_bytes_each_way(launch: Launch, run: str, each_way: int) -> None:
    """Every logged step's push and pull bytes per worker, and the ratio to dense float32."""
    logged = [r for r in read_jsonl(launch.out / run / "metrics.jsonl") if "wire_bytes" in r]
    assert logged and {(r["push_bytes"], r["pull_bytes"]) for r in logged} == {(each_way,) * 2}
    assert {r["dense_bytes"] for r in logged} == {2 * 4 * PARAMETERS}
    assert {r["compression_ratio"] for r in logged} == {4 * PARAMETERS / each_way}


@pytest.mark.parametrize(("framework", "method", "each_way"), [
    ("torch", "topk", sum(8 * (n // 20) for n in CHUNKS)),
    ("tensorflow", "qsgd", sum(n + 4 * -(-n // 512) for n in CHUNKS)),
    pytest.param("tensorflow", "topk", sum(8 * (n // 20) for n in CHUNKS),
                 marks=pytest.mark.long),
    pytest.param("torch", "qsgd", sum(n + 4 * -(-n // 512) for n in CHUNKS),
                 marks=pytest.mark.long)])
def test_compressed_pushes_and_pulls_train_near_uncompressed(ps_launch, framework, method,
                                                             each_way):
    """2 workers + 1 server: top-k at 5% (8 bytes a kept entry each way: 3,824 bytes a step
    against 38,440 dense) and qsgd (a byte an element and a scale per 512: 9,686) train to an
    accuracy near the uncompressed ps run's on digits, every worker with the same parameters
    (they pull the same bits). Not compared with the ring's top-k: the servers select per chunk,
    and again on the pull (docs/parameter-servers.md). 5%, not 1%: in these 5 epochs top-k at 1%
    lands 12 (PyTorch) and 16 (TensorFlow) of 360 samples under, within 7 and 3 of the margin."""
    launch = ps_launch(framework, 2, 1)
    got, want = launch.summary(method)["final"], launch.summary("ps")["final"]
    assert_accuracy_near(got["eval_accuracy"], want["eval_accuracy"], f"ps with {method}")
    assert_bytes_each_way(launch, method, each_way)
    p0, _ = launch.rank(method, 0)
    p1, _ = launch.rank(method, 1)
    assert all(np.array_equal(p0[key], p1[key]) for key in p0)


@frameworks("torch")
def test_top_k_residuals_resume_on_another_number_of_servers(ps_launch, framework):
    """The 1-server top-k run's step-100 checkpoint (step, every worker's and the server's
    residuals) continues on 2 servers to the very parameters the 1-server run ended with."""
    resumed, _ = ps_launch(framework, 2, 2).rank("topk_resumed", 0)
    whole, _ = ps_launch(framework, 2, 1).rank("topk", 0)
    for key in whole:
        assert np.array_equal(resumed[key], whole[key]), key


def pid_of_mpi_rank(rank: int, marker: str) -> int:
    """The process of MPI rank ``rank`` whose command line holds ``marker``."""
    return pid_of_rank(rank, marker, "OMPI_COMM_WORLD_RANK")


def wait_for_checkpoint(run: Path, least: int, timeout: float) -> None:
    """Waits until ``run`` holds a checkpoint manifest of step ``least`` or later, written by the
    ranks themselves (the metrics are written by a process in the idle class, which busy ranks on
    2 cores starve). Any one of them: with ``checkpoint.keep`` a given step's may be gone again
    before a poll sees it."""
    deadline = time.monotonic() + timeout
    while not any(int(path.stem.split("-")[1]) >= least
                  for path in (run / "checkpoints").glob("step-*.json")):
        assert time.monotonic() < deadline, f"no checkpoint of step {least} within {timeout} s"
        time.sleep(0.2)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, ended but not yet reaped, does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


KILLED_BOUND_S = 120
"""How long the workers may outlive a killed server: Open MPI's launcher tears the job down at
once (seconds); the bound is generous for 2 busy cores."""


@pytest.mark.timeout(600)
def test_a_server_killed_ends_the_job_names_its_rank_and_leaves_a_checkpoint_to_resume(tmp_path):
    """SIGKILL to the server (rank 2 of 2 workers + 1 server) mid-run: the job exits 137 (Open
    MPI's launcher passes on the killed rank's signal), names the rank, both workers are gone
    within :data:`KILLED_BOUND_S`, no summary is written, and every checkpoint but one the kill
    may have interrupted verifies; a run on the ring resumes from the newest that verifies."""
    run = tmp_path / "run"
    args = [str(CONFIGS["torch"]), "log.every_steps=5", "log.wandb=disabled", f"log.dir={run}",
            "checkpoint.every_steps=5"]
    proc = subprocess.Popen([str(BIN / "horovodrun"), "-np", "3", "--mpi", str(BIN / "hvdtrain"),
                             "train", *args, "train.epochs=200", "comm.topology=ps"],
                            env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for_checkpoint(run, 10, timeout=300)
        workers = [pid_of_mpi_rank(rank, str(run)) for rank in (0, 1)]
        os.kill(pid_of_mpi_rank(2, str(run)), signal.SIGKILL)
        killed = time.monotonic()
        out, err = proc.communicate(timeout=KILLED_BOUND_S + 60)
        while any(alive(pid) for pid in workers) and time.monotonic() < killed + KILLED_BOUND_S:
            time.sleep(0.2)  # the launcher may exit before its ranks are reaped
        waited = time.monotonic() - killed
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, out[-2000:] + err[-2000:]
    assert re.search(r"process rank 2 with PID \d+ .*exited on signal 9", out + err), err[-3000:]
    print(f"the workers ended {waited:.1f} s after the server was killed")
    assert waited < KILLED_BOUND_S and not any(alive(pid) for pid in workers), waited
    assert not (run / "summary.json").exists()

    saved = sorted((run / "checkpoints").glob("step-*.ckpt"))
    steps = [int(path.stem.split("-")[1]) for path in saved]
    # every 5 steps and at each epoch's end (23 steps)
    assert all(step % 5 == 0 or step % 23 == 0 for step in steps) and steps[-1] >= 10, steps
    valid = [step for step, path in zip(steps, saved, strict=True) if verify(path) is None]
    assert valid in (steps, steps[:-1]), (steps, valid)  # only the last write may be cut short

    # The ring at one process with the same global batch (64) continues from it.
    more, ring = valid[-1] + 5, tmp_path / "ring"
    resumed = subprocess.run([str(BIN / "hvdtrain"), "train", *args, f"log.dir={ring}",
                              "data.batch_size=64", f"train.max_steps={more}",
                              f"checkpoint.resume={saved[steps.index(valid[-1])]}"],
                             env=run_env(), capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((ring / "summary.json").read_text())
    assert summary["steps"] == more and summary["world_size"] == 1
    logged = [r["step"] for r in read_jsonl(ring / "metrics.jsonl") if "step_time_median_s" in r]
    assert logged[0] > valid[-1] and logged[-1] == more, logged  # on from the checkpoint's step
    assert "topology" not in summary  # the ring's


@pytest.mark.timeout(600)
def test_sigterm_to_every_rank_stops_workers_and_server_with_a_checkpoint(tmp_path):
    """SIGTERM to the workers and the server at once (as a scheduler's preemption sends it): the
    server keeps serving until the workers have checkpointed after the same step and said they are
    done; the job exits 75 and the checkpoint verifies."""
    run = tmp_path / "run"
    proc = subprocess.Popen([str(BIN / "horovodrun"), "-np", "3", "--mpi", str(BIN / "hvdtrain"),
                             "train", str(CONFIGS["torch"]), "log.every_steps=5",
                             "log.wandb=disabled", f"log.dir={run}", "train.epochs=200",
                             "checkpoint.every_steps=5", "comm.topology=ps"],
                            env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for_checkpoint(run, 5, timeout=300)
        for rank in (2, 0, 1):  # the server first: it must outlast the signal
            os.kill(pid_of_mpi_rank(rank, str(run)), signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 75, out[-2000:] + err[-2000:]
    stops = re.findall(r"hvdtrain: stopped on request at step (\d+)", out + err)
    assert len(stops) == 2 and stops[0] == stops[1], out[-2000:] + err[-2000:]  # the workers
    assert "parameter server" not in err  # no worker lost its server
    ckpt = run / "checkpoints" / f"step-{int(stops[0]):08d}.ckpt"
    assert verify(ckpt) is None
    assert not (run / "summary.json").exists()
