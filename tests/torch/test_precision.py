"""PyTorch device, precision and synchronized batch norm in one process (Horovod size 1)."""

from __future__ import annotations

import io
import json
import random
from contextlib import contextmanager

import numpy as np
import torch

from hvdtrain.driver import make_dataset, train
from hvdtrain.exchange import GradientExchange, empty_stats
from hvdtrain.step import exchange_and_update
from hvdtrain.torch.data import TorchDatasetSource, TorchLoader
from hvdtrain.torch.device import pinned, pins_memory
from hvdtrain.torch.engine import TorchEngine
from hvdtrain.torch.precision import Precision
from hvdtrain.torch.syncbn import CpuSyncBatchNorm, convert
from tests.conftest import CONFIG, hvdtrain_cli, quiet_config


def test_bf16_autocast_trains_digits_to_the_bar(tmp_path):
    train(quiet_config(CONFIG, tmp_path, "train.precision=bf16"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final"]["eval_accuracy"] >= 0.95
    assert (summary["precision"], summary["device"], summary["skipped_steps"]) == ("bf16", "cpu", 0)
    assert summary["collectives"] in ("gloo", "mpi")


def test_bf16_autocast_computes_in_bf16(tmp_path):
    engine = TorchEngine(quiet_config(CONFIG, tmp_path, "train.precision=bf16"), make_dataset(
        quiet_config(CONFIG, tmp_path)))
    seen = []
    engine.model[1].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    engine.adapter.loss_and_metrics(engine.model, torch.zeros(4, 64), torch.zeros(4, dtype=torch.long))
    assert seen == [torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())


class RecordingOptimizer(torch.optim.SGD):
    """SGD that records each step and what the gradient was then (the loss was scaled by 2**16,
    so the scaled gradient is 2**16 x 3)."""

    def __init__(self, params, calls: list) -> None:
        super().__init__(params, lr=0.1)
        self.calls = calls

    def grad(self) -> float:
        return float(self.param_groups[0]["params"][0].grad)

    def step(self, closure=None):
        self.calls.append(("step", self.grad()))
        return super().step(closure)


class RecordingExchange(GradientExchange):
    """A one-process exchange that records its calls, in the order the step skeleton makes them."""

    def __init__(self, calls: list, unscaled_first: bool) -> None:
        self.calls, self.unscaled_first = calls, unscaled_first
        self.rank, self.size, self.stats = 0, 1, empty_stats()

    def run(self, grads):
        self.calls.append(("exchange", float(grads[0])))
        return list(grads)

    def any_rank(self, flag: bool) -> bool:
        self.calls.append(("any_rank", flag))
        return flag

    @contextmanager
    def updating(self):
        self.calls.append(("updating", None))
        yield
        self.calls.append(("end_update", None))

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        pass


class OneWeight:
    """The two kernels :func:`exchange_and_update` asks for: the precision and the gradients."""

    def __init__(self, precision: Precision, weight: torch.nn.Parameter) -> None:
        self.precision, self.weight = precision, weight

    def gradients(self) -> list:
        return [self.weight.grad]


def fp16_step(factor: float, unscaled_first: bool) -> tuple[torch.nn.Parameter, Precision, list]:
    """One fp16 step of the skeleton on the loss ``weight x factor``: weight, precision, calls."""
    weight = torch.nn.Parameter(torch.tensor([1.0]))
    calls: list = []
    precision = Precision("fp16", torch.device("cpu"))
    precision.attach(RecordingOptimizer([weight], calls))
    precision.backward((weight * factor).sum())
    exchange_and_update(OneWeight(precision, weight), RecordingExchange(calls, unscaled_first))
    return weight, precision, calls


def test_fp16_scaler_order_with_horovods_optimizer():
    """Horovod's documented order: reduce the scaled gradients once, unscale, step without a
    second reduction (inside the exchange's ``updating``, Horovod's ``skip_synchronize``)."""
    weight, precision, calls = fp16_step(3.0, unscaled_first=False)
    scale = 2.0 ** 16
    assert calls == [("exchange", 3.0 * scale), ("updating", None), ("step", 3.0), ("end_update", None)]
    assert not precision.skipped and abs(float(weight.detach()) - 0.7) < 1e-6


def test_fp16_overflow_is_skipped_and_the_scale_lowered():
    weight, precision, calls = fp16_step(float("inf"), unscaled_first=False)
    assert precision.skipped and float(weight.detach()) == 1.0
    assert precision.scaler.get_scale() == 2.0 ** 15
    assert [name for name, _ in calls] == ["exchange", "updating", "end_update"]


def test_fp16_with_hvdtrains_exchange_unscales_before_exchanging():
    weight, precision, calls = fp16_step(3.0, unscaled_first=True)
    # The ranks agree there was no overflow; residuals and averages are in the gradient's units.
    assert calls == [("any_rank", False), ("exchange", 3.0), ("updating", None), ("step", 3.0),
                     ("end_update", None)]
    weight, precision, calls = fp16_step(float("inf"), unscaled_first=True)
    assert calls == [("any_rank", True)] and precision.skipped  # no exchange: every rank skips
    assert float(weight.detach()) == 1.0 and precision.scaler.get_scale() == 2.0 ** 15


class ShardOptimizer(RecordingOptimizer):
    """A sharded optimizer's side of fp16 (:meth:`overflowed`, which the real ones answer with an
    allreduce over the ranks): here it answers ``anywhere``, as if another rank's shard had
    overflowed or not."""

    def __init__(self, params, calls: list, anywhere: bool) -> None:
        super().__init__(params, calls)
        self.anywhere = anywhere

    def overflowed(self, grads) -> bool:
        self.calls.append(("overflowed", float(grads[0])))
        return self.anywhere


def sharded_fp16_step(anywhere: bool) -> tuple[torch.nn.Parameter, Precision, list]:
    """One fp16 step of the skeleton on the loss ``weight x 3`` with a sharded optimizer."""
    weight = torch.nn.Parameter(torch.tensor([1.0]))
    calls: list = []
    precision = Precision("fp16", torch.device("cpu"), loss_scale=1024.0)
    precision.attach(ShardOptimizer([weight], calls, anywhere))
    precision.backward((weight * 3.0).sum())
    exchange_and_update(OneWeight(precision, weight), RecordingExchange(calls, False))
    return weight, precision, calls


def test_fp16_sharded_ranks_decide_the_overflow_together_before_unscaling():
    weight, precision, calls = sharded_fp16_step(anywhere=False)
    assert calls == [("exchange", 3.0 * 1024), ("updating", None), ("overflowed", 3.0 * 1024),
                     ("step", 3.0), ("end_update", None)]
    assert not precision.skipped and precision.loss_scale() == 1024.0
    # This rank's shard is finite, another's overflowed: this rank skips too, and halves.
    weight, precision, calls = sharded_fp16_step(anywhere=True)
    assert [name for name, _ in calls] == ["exchange", "updating", "overflowed", "end_update"]
    assert precision.skipped and precision.loss_scale() == 512.0
    assert float(weight.detach()) == 1.0


def test_fp16_starts_from_the_configured_loss_scale():
    assert Precision("fp16", torch.device("cpu")).loss_scale() == 2.0 ** 16  # torch's own
    assert Precision("fp16", torch.device("cpu"), loss_scale=1024.0).loss_scale() == 1024.0
    assert Precision("bf16", torch.device("cpu")).loss_scale() == 1.0


def test_fp16_checkpoint_carries_the_scaler_and_loads_elsewhere(tmp_path):
    cfg = quiet_config(CONFIG, tmp_path, "train.precision=fp16", "train.max_steps=20")
    result = train(cfg)
    result.engine.precision.scaler.update(1024.0)
    data = result.engine.state_bytes({"step": 20})
    fresh = TorchEngine(cfg, make_dataset(cfg))  # loads through map_location onto its own device
    assert fresh.load_state(data, "test") == {"step": 20}
    assert fresh.precision.scaler.get_scale() == 1024.0
    for key, value in result.engine.parameters().items():
        assert np.array_equal(fresh.parameters()[key], value)


def test_memory_is_pinned_for_a_gpu_and_never_on_cpu(tmp_path):
    """Pinning needs a CUDA runtime (on this CPU torch it raises), so the choice is made by device."""
    assert pins_memory(torch.device("cuda", 0)) and pins_memory(torch.device("cuda"))
    assert not pins_memory(torch.device("cpu"))
    x = torch.zeros(2)
    assert pinned(torch.device("cpu"), x)[0] is x
    cfg = quiet_config(CONFIG, tmp_path)
    engine = TorchEngine(cfg, make_dataset(cfg))
    assert engine.data.device == engine.device == torch.device("cpu")  # the engine hands it over
    batch_x, _ = next(engine.data.eval_batches([np.arange(4)]))  # in memory: the direct path
    assert not batch_x.is_pinned()
    on_disk = TorchDatasetSource([(np.zeros(3, np.float32), 0)] * 8, "train")
    loader = TorchLoader(on_disk, on_disk, seed=0, rank=0, workers=1, prefetch=1,
                         device=torch.device("cpu"))
    assert loader._loader is not None and loader._loader.pin_memory is False


def test_a_checkpoint_with_cuda_random_states_resumes_on_cpu(tmp_path):
    """A GPU rank's checkpoint holds one CUDA generator state per GPU (16 bytes: Philox's seed and
    offset). On a CPU they are ignored and the CPU generators restored, without touching CUDA."""
    cfg = quiet_config(CONFIG, tmp_path)
    engine = TorchEngine(cfg, make_dataset(cfg))
    state = torch.load(io.BytesIO(engine.state_bytes({"step": 7})), weights_only=True)
    drawn = (torch.rand(3), np.random.rand(3), random.random())  # from the states just saved
    assert state["rng"]["cuda"] == []  # written on this CPU: none
    state["rng"]["cuda"] = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    assert engine.load_state(buffer.getvalue(), "gpu checkpoint") == {"step": 7}
    assert torch.equal(torch.rand(3), drawn[0]) and np.array_equal(np.random.rand(3), drawn[1])
    assert random.random() == drawn[2]
    assert not torch.cuda.is_initialized()


def test_cuda_without_a_gpu_is_one_line_before_anything_starts(tmp_path):
    proc = hvdtrain_cli("train", str(CONFIG), f"log.dir={tmp_path / 'run'}", "train.device=cuda",
                        "log.wandb=disabled")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.device='cuda': no GPU is visible" in lines[0]
    assert not (tmp_path / "run").exists()


def test_sync_batchnorm_conversion_keeps_state():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.Sequential(torch.nn.BatchNorm1d(2)))
    model[1].running_mean.fill_(0.5)
    converted = convert(model, torch.device("cpu"))
    assert isinstance(converted[1], CpuSyncBatchNorm) and isinstance(converted[2][0], CpuSyncBatchNorm)
    assert float(converted[1].running_mean[0]) == 0.5
    assert (converted[1].sync_name, converted[2][0].sync_name) == ("hvdtrain.syncbn.model.1",
                                                                   "hvdtrain.syncbn.model.2.0")
