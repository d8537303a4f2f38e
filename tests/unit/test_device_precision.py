"""The framework-free device and precision policy, and the config keys that choose them."""

import pytest

from hvdtrain.config import load_config
from hvdtrain.device import choose_device, describe, gpu_index
from hvdtrain.errors import ConfigError, HvdtrainError
from hvdtrain.precision import MAX_SKIPPED_IN_ROW, SkippedSteps, scales_loss


@pytest.mark.parametrize("requested, gpus, expected", [
    ("auto", 0, "cpu"), ("auto", 2, "cuda"), ("cpu", 4, "cpu"), ("cuda", 1, "cuda")])
def test_device_choice(requested, gpus, expected):
    assert choose_device(requested, gpus) == expected


def test_cuda_without_a_gpu_is_one_line():
    with pytest.raises(HvdtrainError) as err:
        choose_device("cuda", 0)
    assert "train.device='cuda': no GPU is visible" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("local_rank, local_size, gpus, expected", [
    (0, 1, 1, 0), (3, 4, 1, 0), (0, 4, 4, 0), (3, 4, 4, 3), (1, 2, 8, 1)])
def test_one_rank_per_gpu_by_local_rank(local_rank, local_size, gpus, expected):
    assert gpu_index(local_rank, local_size, gpus) == expected


def test_more_ranks_than_gpus_is_refused():
    with pytest.raises(HvdtrainError, match="4 ranks on this host but 2 GPUs visible"):
        gpu_index(3, 4, 2)


def test_summary_names_device_and_collectives():
    assert describe("cuda", 1, True, "gloo") == {"device": "cuda:1", "collectives": "nccl"}
    assert describe("cuda", 0, False, "mpi") == {"device": "cuda:0", "collectives": "mpi"}
    assert describe("cpu", None, True, "gloo") == {"device": "cpu", "collectives": "gloo"}


def test_skipped_steps_tolerated_up_to_the_limit_in_a_row():
    guard = SkippedSteps(limit=3)
    assert not guard.tolerated(False)
    assert [guard.tolerated(True) for _ in range(3)] == [True] * 3
    assert not guard.tolerated(True)  # the fourth in a row: the model itself overflows
    assert not guard.tolerated(False) and guard.in_row == 0
    assert guard.tolerated(True) and guard.total == 5
    assert SkippedSteps().limit == MAX_SKIPPED_IN_ROW


def test_only_fp16_scales_the_loss():
    assert [scales_loss(p) for p in ("fp32", "bf16", "fp16")] == [False, False, True]


def test_config_keys_and_their_choices():
    cfg = load_config(None, ["train.device=cpu", "train.precision=bf16", "model.sync_batchnorm=true"],
                      environ={})
    assert (cfg.train.device, cfg.train.precision, cfg.model.sync_batchnorm) == ("cpu", "bf16", True)
    defaults = load_config(None, [], environ={})
    assert (defaults.train.device, defaults.train.precision, defaults.model.sync_batchnorm) == \
        ("auto", "fp32", False)
    with pytest.raises(ConfigError, match=r"train.device='gpu': must be one of auto, cpu, cuda"):
        load_config(None, ["train.device=gpu"], environ={})
    with pytest.raises(ConfigError, match=r"train.precision='fp8': must be one of fp32, bf16, fp16"):
        load_config(None, ["train.precision=fp8"], environ={})
    with pytest.raises(ConfigError, match=r"model.sync_batchnorm=1: expected true or false"):
        load_config(None, ["model.sync_batchnorm=1"], environ={})


def test_loop_leaves_out_a_skipped_overflow_and_stops_on_too_many():
    from types import SimpleNamespace

    from hvdtrain.loop import Loop
    loop = SimpleNamespace(skipped=SkippedSteps(limit=2))
    inf = {"loss": float("inf"), "count": 8.0, "correct": 3.0}
    assert Loop._skip_check(loop, inf, True) == {"loss": 0.0, "count": 0.0, "correct": 0.0}
    assert Loop._skip_check(loop, {"loss": 1.5, "count": 8.0}, True) == {"loss": 1.5, "count": 8.0}
    third = Loop._skip_check(loop, {"loss": 1.5, "count": 8.0}, True)  # over the limit: diverged
    assert third["loss"] != third["loss"]  # NaN, which the loop reports as divergence
    assert Loop._skip_check(loop, inf, False) is inf  # not skipped: the loop's divergence check sees it


def test_the_first_loss_scale_is_fp16s_and_a_power_of_two():
    cfg = load_config(None, ["train.precision=fp16", "train.loss_scale=16777216"], environ={})
    assert cfg.train.loss_scale == 2.0 ** 24
    assert load_config(None, [], environ={}).train.loss_scale == 0.0  # the framework's own
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.precision=bf16", "train.loss_scale=1024"], environ={})
    assert str(info.value) == ("train.loss_scale=1024.0 does nothing with train.precision="
                               "'bf16': only fp16 scales the loss; set train.precision=fp16 or "
                               "leave train.loss_scale at its default 0.0")
    with pytest.raises(ConfigError, match=r"^train.loss_scale=1000: the loss scale must be a "
                                          r"power of two") as info:
        load_config(None, ["train.precision=fp16", "train.loss_scale=1000"], environ={})
    assert "\n" not in str(info.value)
