"""scripts/cuda_env.sh, which HVDTRAIN_CUDA=1 set-up and the GPU check use: the CUDA toolkit and NCCL
from the machine or from pip's nvidia-* wheels, says which, and a clear message when one is missing.
Machines are faked: a toolkit directory with an nvcc script, a site-packages with wheel layouts."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def fake_python(tmp: Path, site: Path) -> Path:
    """An interpreter whose purelib is ``site``: all cuda_env.sh asks of it."""
    return executable(tmp / "bin" / "python", f"#!/bin/sh\necho {site}\n")


def toolkit(root: Path) -> Path:
    executable(root / "bin" / "nvcc", f"#!/bin/sh\necho '#$ TOP={root}/bin/..' >&2\n")
    (root / "include").mkdir(parents=True, exist_ok=True)
    return root


def nccl_wheel(site: Path) -> Path:
    base = site / "nvidia" / "nccl"
    (base / "include").mkdir(parents=True)
    (base / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n")
    (base / "lib").mkdir()
    (base / "lib" / "libnccl.so.2").write_text("")
    return base


def detect(tmp: Path, python: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    script = (f"source {ROOT}/scripts/cuda_env.sh; cuda_detect {python} {tmp}/links || "
              "{ echo \"PROBLEM $CUDA_PROBLEM\"; exit 1; }; echo \"CUDA $CUDA_FROM\"; "
              "echo \"NCCL $NCCL_FROM\"; echo \"VARS $HOROVOD_CUDA_HOME $HOROVOD_NCCL_INCLUDE "
              "$HOROVOD_NCCL_LIB $HOROVOD_NCCL_LINK\"")
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{tmp}/path:/usr/bin:/bin", "HOME": str(tmp),
                               "HVDTRAIN_CUDA_PREFIXES": f"{tmp}/none", **env})


def lines(proc: subprocess.CompletedProcess) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in proc.stdout.splitlines())


def test_machine_toolkit_and_pip_nccl(tmp_path):
    """The GPU machine's case: nvcc installed (here behind a wrapper on PATH), NCCL from the wheel."""
    cuda = toolkit(tmp_path / "cuda-13.0")
    executable(tmp_path / "path" / "nvcc", f"#!/bin/sh\nexec {cuda}/bin/nvcc \"$@\"\n")
    site = tmp_path / "site"
    wheel = nccl_wheel(site)
    proc = detect(tmp_path, fake_python(tmp_path, site), {})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = lines(proc)
    assert found["CUDA"] == f"the machine ({cuda})"
    assert found["NCCL"] == f"pip's nvidia-nccl wheel ({wheel})"
    assert found["VARS"] == f"{cuda} {wheel}/include {tmp_path}/links SHARED"
    assert os.readlink(tmp_path / "links" / "libnccl.so") == str(wheel / "lib" / "libnccl.so.2")


def test_machine_nccl_beside_the_toolkit(tmp_path):
    cuda = toolkit(tmp_path / "cuda")
    (cuda / "include" / "nccl.h").write_text("")
    (cuda / "lib64").mkdir()
    (cuda / "lib64" / "libnccl.so").write_text("")
    proc = detect(tmp_path, fake_python(tmp_path, tmp_path / "site"), {"CUDA_HOME": str(cuda)})
    assert lines(proc)["NCCL"] == f"the machine ({cuda}/include)"
    assert lines(proc)["VARS"] == f"{cuda} {cuda}/include {cuda}/lib64 SHARED"


def test_toolkit_from_pip_wheels(tmp_path):
    site = tmp_path / "site"
    nvcc_root = toolkit(site / "nvidia" / "cuda_nvcc")
    nccl_wheel(site)
    proc = detect(tmp_path, fake_python(tmp_path, site), {})
    assert lines(proc)["CUDA"] == f"pip's nvidia-* wheels ({nvcc_root})"


def test_neither_stops_with_what_is_missing(tmp_path):
    cuda = toolkit(tmp_path / "cuda")
    proc = detect(tmp_path, fake_python(tmp_path, tmp_path / "site"), {"CUDA_HOME": str(cuda)})
    assert proc.returncode == 1
    problem = lines(proc)["PROBLEM"]
    assert problem.startswith(f"HVDTRAIN_CUDA=1 needs the CUDA toolkit (nvcc) and NCCL (nccl.h, "
                              f"libnccl): found toolkit: {cuda}, NCCL: none")
    assert "pip install nvidia-cuda-nvcc and nvidia-nccl" in problem
