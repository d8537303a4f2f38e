"""The set-up script: a repeat run does nothing, and a failed step names itself and what to do."""

import os
import shutil
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]


def run_setup(timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Runs ``setup.sh`` in a session of its own, so that a timeout ends the builds it started too."""
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "setup.sh")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_second_setup_only_checks():
    # `make test` has just run the set-up, so every step must find its work done.
    proc = run_setup(120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("==> [setup]")]
    assert [line.split(":")[0] for line in lines[:5]] == [
        "==> [setup] system packages", "==> [setup] virtual environment",
        "==> [setup] python packages", "==> [setup] horovod 0.28.1", "==> [setup] hvdtrain"]
    assert "python packages: up to date" in proc.stdout and "horovod 0.28.1: installed" in proc.stdout
    assert "pip install" not in proc.stdout and "building" not in proc.stdout


def test_a_failed_step_names_itself_and_the_remedy(tmp_path):
    for name in ("scripts/setup.sh", "scripts/horovod_source.sh", "requirements.in", "constraints.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    proc = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                                       "HVDTRAIN_PYTHON": "/bin/false"})
    assert proc.returncode == 1
    assert f'step "virtual environment: create {tmp_path}/.venv" failed: install python3-venv' \
        in proc.stderr
