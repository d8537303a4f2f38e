"""Tests of the patched Horovod build itself, each starting `horovodrun -np 2`."""

import json
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


def rank_records(stdout: str) -> list[dict]:
    """The JSON objects that ranks printed as ``{"rank": ...}`` lines, behind horovodrun's
    ``[N]<stdout>:`` prefix, in output order."""
    return [json.loads(line.split(":", 1)[1]) for line in stdout.splitlines()
            if line.split(":", 1)[-1].startswith('{"rank"')]
