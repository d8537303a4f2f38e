"""The local one-node Slurm cluster (``bash scripts/slurm_local.sh start``, which ``make test`` runs
first): the tests that submit jobs ask for it."""

from __future__ import annotations

import shutil
import subprocess

import pytest


@pytest.fixture(scope="session")
def cluster() -> None:
    """Fails unless the Slurm clients are installed and a controller answers."""
    assert shutil.which("sbatch"), "Slurm is not installed: run `bash scripts/slurm_local.sh start`"
    info = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    assert info.returncode == 0 and info.stdout.strip(), f"no local cluster: {info.stderr}"
