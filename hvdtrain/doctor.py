"""``hvdtrain doctor``: versions, Horovod build facts, GPUs and NCCL, whether the trainers can run.

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
    except Exception as exc:  # noqa: BLE001  (any import failure is what the doctor reports)
        return Check(module, False, f"cannot import: {exc}")
    return Check(module, True, getattr(mod, "__version__", "?"))


def _horovod_framework(framework: str) -> list[Check]:
    """Imports ``horovod.<framework>`` and asks which controllers and ops it was built with."""
    name = f"horovod.{framework}"
    try:
        hvd = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001  (a broken build raises anything: it is the finding)
        return [Check(name, False, f"cannot import ({exc}); rerun scripts/setup.sh")]
    built = {what: getattr(hvd, f"{what}_built")() for what in ("gloo", "mpi", "nccl")}
    detail = ", ".join(f"{what}={'yes' if ok else 'no'}" for what, ok in built.items())
    ok = built["gloo"] and built["mpi"]
    return [Check(name, ok, detail + ("" if ok else " (Gloo and MPI are both needed)"))]


def _gpus() -> list[Check]:
    """The GPUs this process sees (through PyTorch's CUDA runtime), the NCCL PyTorch carries, and
    whether Horovod was built to reduce GPU tensors with NCCL. A machine without GPUs passes: it
    trains on the CPU."""
    try:
        torch = importlib.import_module("torch")
    except Exception as exc:  # noqa: BLE001  (as for _version: the failure is the finding)
        return [Check("gpus", False, f"cannot ask torch: {exc}")]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        built = "CUDA build" if torch.version.cuda else "CPU-only build"
        return [Check("gpus", True, f"none visible (torch {built}; training runs on the CPU)")]
    names = ", ".join(f"{i}: {torch.cuda.get_device_name(i)}" for i in range(count))
    checks = [Check("gpus", True, f"{count} visible, CUDA {torch.version.cuda} ({names})")]
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        checks.append(Check("nccl", True, f"{nccl} (PyTorch's)"))
    except Exception as exc:  # noqa: BLE001  (a build without NCCL raises what it raises)
        checks.append(Check("nccl", False, f"PyTorch has none: {exc}"))
    try:
        hvd_nccl = importlib.import_module("horovod.torch").nccl_built()
    except Exception:  # noqa: BLE001  (the import's own failure is reported by _horovod_framework)
        hvd_nccl = False
    checks.append(Check("horovod nccl", bool(hvd_nccl),
                        "built with NCCL: GPU tensors are reduced on the GPUs" if hvd_nccl else
                        "Horovod was built without NCCL; rebuild with HVDTRAIN_CUDA=1 "
                        "scripts/setup.sh"))
    return checks


def _executable(name: str) -> Check:
    local = Path(sys.executable).parent / name
    path = str(local) if local.exists() else shutil.which(name)
    return Check(name, path is not None, path or "not found on PATH")


def run_checks() -> list[Check]:
    """Every check, in report order."""
    # TensorFlow's start-up chatter is not a finding.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    checks = [Check("python", sys.version_info >= (3, 10), platform.python_version()),
              Check("hvdtrain", True, hvdtrain.__version__)]
    checks += [_version(m) for m in ("numpy", "yaml", "sklearn", "torch", "tensorflow", "horovod")]
    checks += _horovod_framework("torch") + _horovod_framework("tensorflow")
    checks += [_executable("horovodrun"), _executable("mpirun")]
    checks += _gpus()
    return checks


def doctor(quiet: bool = False) -> int:
    """Prints the report (only problems when ``quiet``); returns 0 when all is there, else 1."""
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
