"""``hvdtrain doctor``'s GPU lines, against stand-ins for torch's CUDA runtime and Horovod's build."""

import sys
from types import SimpleNamespace

import pytest

from hvdtrain.doctor import _gpus


def fake_torch(count: int, cuda: str | None = "13.0") -> SimpleNamespace:
    return SimpleNamespace(
        version=SimpleNamespace(cuda=cuda),
        cuda=SimpleNamespace(is_available=lambda: count > 0, device_count=lambda: count,
                             get_device_name=lambda i: "NVIDIA H200",
                             nccl=SimpleNamespace(version=lambda: (2, 27, 7))))


@pytest.fixture
def modules(monkeypatch):
    def install(count: int, nccl_built: bool, cuda: str | None = "13.0") -> None:
        monkeypatch.setitem(sys.modules, "torch", fake_torch(count, cuda))
        monkeypatch.setitem(sys.modules, "horovod.torch", SimpleNamespace(nccl_built=lambda: nccl_built))
    return install


def test_no_gpu_passes_and_says_cpu(modules):
    modules(0, False, cuda=None)
    [check] = _gpus()
    assert check.ok and check.detail.startswith("none visible (torch CPU-only build")


def test_gpus_nccl_and_horovod_built_with_it(modules):
    modules(2, True)
    checks = {c.name: c for c in _gpus()}
    assert checks["gpus"].ok and checks["gpus"].detail.startswith("2 visible, CUDA 13.0 (0: NVIDIA H200")
    assert checks["nccl"].detail == "2.27.7 (PyTorch's)"
    assert checks["horovod nccl"].ok


def test_gpus_with_a_horovod_built_without_nccl_fail(modules):
    modules(1, False)
    check = {c.name: c for c in _gpus()}["horovod nccl"]
    assert not check.ok and "HVDTRAIN_CUDA=1 scripts/setup.sh" in check.detail
