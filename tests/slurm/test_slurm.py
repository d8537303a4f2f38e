"""hvdtrain's Slurm job scripts, rendered and checked here and run on the real local cluster
(`bash scripts/slurm_local.sh start`, which `make test` runs first)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdtrain.errors import HvdtrainError
from hvdtrain.slurm import DISCOVERY, TEMPLATES, JobOptions, check, discovery_script, render
from tests.conftest import CONFIG, ROOT, hvdtrain_cli

TRAIN_SAMPLES = 1437  # digits: 1,797 samples, 20% held out
MALICIOUS = "a b; $(touch pwned)"


def quiet(tmp_path: Path, *more: str) -> list[str]:
    return [f"log.dir={tmp_path / 'run'}", "log.wandb=disabled", "log.console=false", *more]


def test_malicious_values_stay_literal(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = [f"log.dir={tmp_path / MALICIOUS}", "name=$(rm -rf /)"]
    text = render(CONFIG, overrides, JobOptions(tasks_per_node=2))
    assert f"'log.dir={tmp_path / MALICIOUS}'" in text
    assert "'name=$(rm -rf /)'" in text
    assert check(CONFIG, overrides, JobOptions(tasks_per_node=2), script=text) == []
    # bash parses the script without running anything: the quoted values come out as literal words
    subprocess.run(["bash", "-n", "-c", text], check=True)
    assert not list(tmp_path.rglob("pwned"))


def test_check_reports_process_count_mismatch(tmp_path):
    options = JobOptions(nodes=1, tasks_per_node=2)
    text = render(CONFIG, quiet(tmp_path), options).replace("-np 2 ", "-np 3 ")
    problems = check(CONFIG, quiet(tmp_path), options, script=text)
    assert any("starts 3 ranks" in p and "= 2" in p for p in problems), problems


def test_check_reports_short_signal_lead(tmp_path):
    problems = check(CONFIG, quiet(tmp_path), JobOptions(signal_lead=10))
    assert any("--signal-lead=10s" in p for p in problems), problems
    assert check(CONFIG, quiet(tmp_path), JobOptions(signal_lead=120)) == []


def test_check_reports_unquoted_value(tmp_path):
    overrides = quiet(tmp_path, "name=x y")
    text = render(CONFIG, overrides).replace("'name=x y'", "name=x y")
    assert any("not shell-quoted" in p for p in check(CONFIG, overrides, script=text))


GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("name, options", [
    ("train_cpu", JobOptions(nodes=2, tasks_per_node=4, time="02:00:00", partition="cpu", account="proj",
                             network_interface="eth1")),
    ("train_gpu", JobOptions(nodes=2, tasks_per_node=4, gpus_per_node=4, launcher="srun",
                             signal_lead=300, network_interface="ib0")),
])
def test_rendered_script_matches_golden_file(tmp_path, monkeypatch, name, options):
    """The whole rendered script, with this machine's paths replaced; regenerate after a deliberate
    template change with HVDTRAIN_REGEN_GOLDEN=1 and review the diff."""
    monkeypatch.chdir(tmp_path)
    text = render(CONFIG, ["log.dir=runs/golden", "train.epochs=30"], options)
    text = (text.replace(str(Path(sys.executable).parent), "<BIN>")
            .replace(str(ROOT), "<ROOT>").replace(str(tmp_path), "<CWD>"))
    golden = GOLDEN / f"{name}.sbatch"
    if os.environ.get("HVDTRAIN_REGEN_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_a_checkout_reads_the_templates_from_its_top_level_slurm_directory():
    assert TEMPLATES == ROOT / "slurm"
    assert discovery_script() == ROOT / "slurm" / DISCOVERY
    assert os.access(discovery_script(), os.X_OK)


def test_gpu_options_are_checked(tmp_path):
    options = JobOptions(tasks_per_node=2, gpus_per_node=4)
    problems = check(CONFIG, quiet(tmp_path), options, script=render(CONFIG, quiet(tmp_path), options))
    assert any("one rank per GPU" in p for p in problems), problems
    options = JobOptions(tasks_per_node=2, gpus_per_node=2, launcher="srun")
    problems = check(CONFIG, quiet(tmp_path), options)
    if shutil.which("sbatch"):  # this cluster has no GPUs: sbatch --test-only must refuse the gres
        assert len(problems) == 1 and "gres" in problems[0], problems
    else:
        assert problems == []


def test_gpu_ranks_see_one_device_each(tmp_path):
    """The rank wrapper of a GPU script, run as bash would run it for local ranks 0 and 1 of a node
    that Slurm gave GPUs 2 and 3: each rank sees exactly its own GPU."""
    text = render(CONFIG, quiet(tmp_path), JobOptions(tasks_per_node=2, gpus_per_node=2, launcher="srun"))
    wrapper = re.search(r"RANK_WRAPPER='(.*?)'\n", text, re.S).group(1)
    for local_rank, expected in (("0", "2"), ("1", "3")):
        env = {**os.environ, "SLURM_LOCALID": local_rank, "CUDA_VISIBLE_DEVICES": "2,3",
               "HVDTRAIN_STOP_FLAG": str(tmp_path / "flag")}
        env.pop("HOROVOD_LOCAL_RANK", None)
        env.pop("OMPI_COMM_WORLD_LOCAL_RANK", None)
        out = subprocess.run(["bash", "-c", wrapper, "rank", "bash", "-c", 'echo "$CUDA_VISIBLE_DEVICES"'],
                             env=env, capture_output=True, text=True, check=True).stdout
        assert out.strip() == expected


@pytest.mark.parametrize("options, message", [
    (JobOptions(launcher="mpirun"), "--launcher='mpirun'"),
    (JobOptions(gpus_per_node=-1), "--gpus-per-node=-1"),
])
def test_bad_launch_options_are_user_errors(tmp_path, options, message):
    with pytest.raises(HvdtrainError, match=re.escape(message)):
        render(CONFIG, quiet(tmp_path), options)


@pytest.mark.parametrize("options, message", [
    (JobOptions(nodes=0), "--nodes=0"),
    (JobOptions(time="1h"), "--time='1h'"),
    (JobOptions(partition="a;b"), "--partition='a;b'"),
    (JobOptions(controller="nccl"), "--controller='nccl'"),
    (JobOptions(mem_per_cpu="1.5G"), "--mem-per-cpu='1.5G'"),
])
def test_bad_options_are_user_errors(tmp_path, options, message):
    with pytest.raises(HvdtrainError, match=re.escape(message)):
        render(CONFIG, quiet(tmp_path), options)


@pytest.mark.parametrize("overrides, options, message", [
    ((), JobOptions(server_nodes=1, controller="mpi"), "needs comm.topology=ps"),
    (("comm.topology=ps",), JobOptions(server_nodes=1), "talk over MPI"),
    (("comm.topology=ps", "ps.servers=3"), JobOptions(server_nodes=2, tasks_per_node=2,
                                                      launcher="srun"), "must be a multiple of it"),
    (("comm.topology=ps", "ps.servers=4"), JobOptions(server_nodes=1, tasks_per_node=2,
                                                      launcher="srun"), "at most --tasks-per-node=2"),
])
def test_server_nodes_need_a_config_they_can_serve(tmp_path, overrides, options, message):
    with pytest.raises(HvdtrainError, match=re.escape(message)):
        render(CONFIG, quiet(tmp_path, *overrides), options)


def test_server_nodes_put_the_servers_last(tmp_path):
    """Two worker nodes of 2 ranks, one server node of 2 servers: 6 ranks, in host order."""
    overrides = quiet(tmp_path, "comm.topology=ps", "ps.servers=2")
    options = JobOptions(nodes=2, tasks_per_node=2, server_nodes=1, controller="mpi")
    text = render(CONFIG, overrides, options)
    assert "#SBATCH --nodes=3\n" in text and " -np 6 " in text
    problems = check(CONFIG, overrides, options, script=text)  # sbatch here has one node: skip it
    assert [p for p in problems if "sbatch --test-only" not in p] == [], problems
    script = text[text.index('HOSTS="" SLOTS=()'):text.index("descendants()")]
    hosts = subprocess.run(["bash", "-c", script + 'echo "$HOSTS"'], capture_output=True, text=True,
                           env={"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "a,b,c"})
    assert hosts.stdout.strip() == "a:2,b:2,c:2", hosts.stderr


def test_cli_bad_option_exits_2(tmp_path):
    proc = hvdtrain_cli("slurm", "check", str(CONFIG), *quiet(tmp_path), "--time", "soon")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--time='soon'" in proc.stderr


# --- on the real cluster ------------------------------------------------------------------

def job_field(job_id: str, name: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    found = re.search(rf"\b{name}=(\S+)", out)
    return found.group(1) if found else ""


def wait_state(job_id: str, states: set[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_field(job_id, "JobState")
        if state in states:
            return state
        time.sleep(1)
    raise AssertionError(f"job {job_id} still {job_field(job_id, 'JobState')} after {timeout} s")


def submit(run_dir: Path, *overrides: str, options: tuple[str, ...] = (), config: Path = CONFIG) -> str:
    proc = hvdtrain_cli("slurm", "submit", str(config), f"log.dir={run_dir}", "log.wandb=disabled",
                        *overrides, "--nodes", "1", "--tasks-per-node", "2", "--time", "20:00", *options)
    assert proc.returncode == 0, proc.stderr
    found = re.search(r"submitted job (\d+)", proc.stdout)
    assert found, proc.stdout
    return found.group(1)


def job_log(run_dir: Path, job_id: str) -> str:
    path = run_dir / f"slurm-{job_id}.out"
    return path.read_text() if path.exists() else "(no log)"


@pytest.mark.parametrize("options", [
    (),
    ("--launcher", "srun"),
    # one node: elastic Horovod needs the interface named when it has a single host
    ("--elastic", "--network-interface", "lo"),
], ids=["horovodrun", "srun", "elastic"])
def test_submitted_job_trains_two_ranks(cluster, tmp_path, options):
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, "train.epochs=15", options=options)
    state = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=300)
    assert state == "COMPLETED", job_log(run_dir, job_id)
    assert job_field(job_id, "Restarts") == "0"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["final"]["eval_accuracy"] >= 0.95
    assert (run_dir / "job.sbatch").exists()
    assert "restart count 0" in job_log(run_dir, job_id)


@pytest.mark.long  # make test: the two-node preemption (tests/cluster/test_slurm_nodes.py)
def test_preempted_job_requeues_and_resumes(cluster, tmp_path):
    run_dir, epochs = tmp_path / "run", 60
    job_id = submit(run_dir, f"train.epochs={epochs}", "log.every_steps=5", "checkpoint.every_steps=1000")
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline, job_log(run_dir, job_id)
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    state = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=420)
    log = job_log(run_dir, job_id)
    assert state == "COMPLETED", log
    assert job_field(job_id, "Restarts") == "1", log
    assert "requeueing job" in log and "restart count 1" in log, log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["samples"] == epochs * TRAIN_SAMPLES
    assert summary["world_size"] == 2
    assert summary["final"]["eval_accuracy"] >= 0.95
    steps = [record["step"] for record in map(json.loads, metrics.read_text().splitlines())]
    assert steps == sorted(set(steps)), "a step was logged twice after the resume"
