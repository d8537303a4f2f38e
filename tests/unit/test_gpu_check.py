"""scripts/gpu_check.sh on a machine without a usable GPU: one clean line and exit 77, nothing run;
and where it finds the Horovod sdist it builds from (scripts/horovod_source.sh)."""

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


def find_sdist(tmp_path: Path, sha_of: Path | None, **env: str) -> tuple[str, str, int]:
    """scripts/horovod_source.sh's find_horovod_sdist for a tree at tmp_path/tree and a set-up
    cache at tmp_path/cache; the expected sha256 is that of ``sha_of`` (a stand-in sdist)."""
    script = (f'source "{ROOT}/scripts/horovod_source.sh"\n'
              + (f'HOROVOD_SDIST_SHA256="$(sha256sum "{sha_of}" | cut -d" " -f1)"\n' if sha_of else "")
              + f'find_horovod_sdist "{tmp_path}/tree" "{tmp_path}/cache"; rc=$?\n'
              'printf "%s\\n%s\\n%s\\n" "$SDIST_FOUND" "$SDIST_PROBLEM" "$rc"\n')
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", **env})
    found, problem, rc = proc.stdout.split("\n")[:3]
    return found, problem, int(rc)


def test_the_sdist_is_found_in_order_env_tree_cache(tmp_path):
    name = "horovod-0.28.1.tar.gz"
    tree, cache, explicit = tmp_path / "tree" / ".cache" / name, tmp_path / "cache" / name, tmp_path / name
    for path in (tree, cache, explicit):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"stand-in sdist")
    assert find_sdist(tmp_path, explicit, HOROVOD_SDIST=str(explicit)) == (str(explicit), "", 0)
    assert find_sdist(tmp_path, explicit) == (str(tree), "", 0)
    tree.unlink()
    assert find_sdist(tmp_path, explicit) == (str(cache), "", 0)
    cache.unlink()
    found, problem, rc = find_sdist(tmp_path, explicit)
    assert (found, rc) == ("", 1)
    assert problem == (f"no {name} in {tmp_path}/tree/.cache or {tmp_path}/cache: copy it to "
                       f"{tmp_path}/tree/.cache/ (scripts/setup.sh keeps one in {tmp_path}/cache) "
                       "or set HOROVOD_SDIST")
    assert find_sdist(tmp_path, explicit, HOROVOD_SDIST=str(cache))[1:] == (
        f"HOROVOD_SDIST={cache}: no such file", 1)


def test_an_sdist_that_is_not_pypis_is_refused(tmp_path):
    explicit = tmp_path / "horovod-0.28.1.tar.gz"
    explicit.write_bytes(b"not the real sdist")
    assert find_sdist(tmp_path, None, HOROVOD_SDIST=str(explicit)) == (
        "", f"{explicit} is not PyPI's horovod-0.28.1.tar.gz (sha256 differs): replace it with that file", 1)
