"""Shared helpers: the project's own executables and a `horovodrun` launcher with a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvdtrain.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONFIG = ROOT / "configs" / "digits_torch.yaml"
TF_CONFIG = ROOT / "configs" / "digits_tf.yaml"


def run_env() -> dict[str, str]:
    """The environment for launched processes: Open MPI allowed as root, repo importable."""
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    return env


def horovodrun(np: int, controller: str, argv: list[str], timeout: float = 300,
               cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Runs ``horovodrun -np N --gloo|--mpi argv`` and returns it; output is kept for messages."""
    cmd = [str(BIN / "horovodrun"), "-np", str(np), f"--{controller}", *argv]
    proc = subprocess.run(cmd, cwd=cwd, env=run_env(), capture_output=True, text=True,
                          timeout=timeout)
    return proc


def hvdtrain_cli(*args: str, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Runs the installed ``hvdtrain`` console script."""
    return subprocess.run([str(BIN / "hvdtrain"), *args], cwd=cwd, env=run_env(),
                          capture_output=True, text=True, timeout=timeout)


def quiet_config(config: Path, tmp_path: Path, *overrides: str) -> Config:
    """A config from ``config`` that writes to ``tmp_path/run``, prints nothing and starts no W&B
    run (its service process takes seconds; the sink's own tests turn it on)."""
    return load_config(config, [f"log.dir={tmp_path / 'run'}", "log.console=false",
                                "log.wandb=disabled", *overrides], environ={})


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file."""
    return [json.loads(line) for line in path.read_text().splitlines()]


# Set by pytest itself, by torch on its first use (OpenMP and inductor settings), and by hvdtrain's
# engines before the process's first hvd.init (Horovod's cycle time, Open MPI's yielding), which
# hold for the life of the process, as Horovod starts once per process: not leaks of a test.
FRAMEWORK_SET = ("PYTEST_CURRENT_TEST", "KMP_", "TORCHINDUCTOR_", "HOROVOD_CYCLE_TIME",
                 "OMPI_MCA_mpi_yield_when_idle")


@pytest.fixture(autouse=True)
def no_leaked_environment():
    """Fails a test that leaves environment variables changed behind it."""
    before = dict(os.environ)
    yield
    changed = {k for k in set(before) | set(os.environ)
               if before.get(k) != os.environ.get(k) and not k.startswith(FRAMEWORK_SET)}
    assert not changed, f"test leaked environment variables: {sorted(changed)}"
