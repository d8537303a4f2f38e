"""Tests of the patched Horovod build itself, each starting `horovodrun -np 2`."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def horovodrun(*args: str, timeout: int = 600, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess:
    """Runs `horovodrun -np 2 --gloo ARGS` from the project root (``env`` added to the
    environment) and returns its output."""
    return subprocess.run([str(BIN / "horovodrun"), "-np", "2", "--gloo", *args], cwd=ROOT,
                          env={**ENV, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
