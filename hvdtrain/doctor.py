"""``hvdtrain doctor``: versions and Horovod build facts, and whether the trainers can run.

The frameworks are imported here by name only when the doctor runs, never when hvdtrain is imported.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import hvdtrain


@dataclass
class Check:
    """One line of the doctor's report."""

    name: str
    ok: bool
    detail: str


def _version(module: str) -> Check:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # any import failure is what the doctor reports
        return Check(module, False, f"cannot import: {exc}")
    return Check(module, True, getattr(mod, "__version__", "?"))


def _horovod_framework(framework: str) -> list[Check]:
    """Imports ``horovod.<framework>`` and asks which controllers and ops it was built with."""
    name = f"horovod.{framework}"
    try:
        hvd = importlib.import_module(name)
    except Exception as exc:
        return [Check(name, False, f"cannot import ({exc}); rerun scripts/setup.sh")]
    built = {what: getattr(hvd, f"{what}_built")() for what in ("gloo", "mpi", "nccl")}
    detail = ", ".join(f"{what}={'yes' if ok else 'no'}" for what, ok in built.items())
    ok = built["gloo"] and built["mpi"]
    return [Check(name, ok, detail + ("" if ok else " (Gloo and MPI are both needed)"))]


def _executable(name: str) -> Check:
    local = Path(sys.executable).parent / name
    path = str(local) if local.exists() else shutil.which(name)
    return Check(name, path is not None, path or "not found on PATH")


def run_checks() -> list[Check]:
    """Every check, in report order."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter is not a finding
    checks = [Check("python", sys.version_info >= (3, 10), platform.python_version()),
              Check("hvdtrain", True, hvdtrain.__version__)]
    checks += [_version(m) for m in ("numpy", "yaml", "sklearn", "torch", "tensorflow", "horovod")]
    checks += _horovod_framework("torch") + _horovod_framework("tensorflow")
    checks += [_executable("horovodrun"), _executable("mpirun")]
    return checks


def doctor(quiet: bool = False) -> int:
    """Prints the report (only problems when ``quiet``); returns 0 when everything is there, else 1."""
    checks = run_checks()
    for check in checks:
        if not (quiet and check.ok):
            print(f"{'ok ' if check.ok else 'BAD'}  {check.name:<20} {check.detail}")
    failed = [c.name for c in checks if not c.ok]
    if failed:
        print(f"hvdtrain doctor: missing or broken: {', '.join(failed)}; run scripts/setup.sh")
        return 1
    print(f"hvdtrain doctor: all {len(checks)} checks passed")
    return 0
