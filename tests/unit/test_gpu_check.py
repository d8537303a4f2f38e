"""scripts/gpu_check.sh on a machine without a usable GPU: one clean line and exit 77, nothing run."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def run(tmp_path: Path, path: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True,
                          text=True, timeout=120, env={"PATH": path, "HOME": str(tmp_path),
                                                       "HVDTRAIN_GPU_PYTHON": sys.executable,
                                                       "OUT": str(tmp_path / "out")})


def test_no_nvidia_smi(tmp_path):
    proc = run(tmp_path, "/usr/bin:/bin")
    assert proc.returncode == 77
    assert proc.stdout == "gpu_check: no NVIDIA GPU on this machine (nvidia-smi not found); nothing checked\n"


def test_a_gpu_but_no_cuda_pytorch(tmp_path):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    fake.chmod(0o755)
    proc = run(tmp_path, f"{fake.parent}:/usr/bin:/bin")
    assert proc.returncode == 77, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("has no PyTorch with CUDA (torch.cuda.is_available() is false); "
                                        "nothing checked")
