"""The set-up script: a repeat run does nothing, and a failed step names itself and what to do."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_a_second_setup_only_checks():
    # `make test` has just run the set-up, so every step must find its work done.
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True,
                          text=True, timeout=120, check=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("==> [setup]")]
    assert [line.split(":")[0] for line in lines[:5]] == [
        "==> [setup] system packages", "==> [setup] virtual environment",
        "==> [setup] python packages", "==> [setup] horovod 0.28.1", "==> [setup] hvdtrain"]
    assert "python packages: up to date" in proc.stdout and "horovod 0.28.1: installed" in proc.stdout
    assert "pip install" not in proc.stdout and "building" not in proc.stdout


def test_a_failed_step_names_itself_and_the_remedy(tmp_path):
    for name in ("scripts/setup.sh", "requirements.in", "constraints.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    proc = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                                       "HVDTRAIN_PYTHON": "/bin/false"})
    assert proc.returncode == 1
    assert f'step "virtual environment: create {tmp_path}/.venv" failed: install python3-venv' \
        in proc.stderr
