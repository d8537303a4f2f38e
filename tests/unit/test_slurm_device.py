"""``hvdtrain slurm check``: ``train.device`` against the job's ``--gpus-per-node``."""

import pytest

from hvdtrain.slurm import JobOptions, check, render
from tests.conftest import CONFIG


@pytest.mark.parametrize("device, gpus, expected", [
    ("cuda", 0, "train.device=cuda but no --gpus-per-node: the ranks would see no GPU and stop"),
    ("cpu", 2, "train.device=cpu but --gpus-per-node=2: the allocated GPUs would sit idle"),
    ("auto", 2, None), ("cuda", 2, None), ("auto", 0, None)])
def test_device_against_gpus_per_node(tmp_path, device, gpus, expected):
    overrides = [f"log.dir={tmp_path / 'run'}", "log.wandb=disabled", f"train.device={device}"]
    options = JobOptions(tasks_per_node=2, gpus_per_node=gpus, launcher="srun")
    problems = check(CONFIG, overrides, options, script=render(CONFIG, overrides, options))
    device_problems = [p for p in problems if p.startswith("train.device")]
    assert device_problems == ([expected] if expected else [])
