"""Data on disk with PyTorch: parallel workers change nothing that a step trains on (resume stays
bit-identical), a user's torch Dataset plugs in, and bad data stops the run or is skipped."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from hvdtrain.driver import train
from hvdtrain.errors import HvdtrainError
from tests.conftest import ROOT, quiet_config
from tests.image_data import image_folder

CONFIG = ROOT / "configs" / "images_torch.yaml"
# A small MLP with dropout keeps the run short and draws random numbers every step; the images
# are cropped and flipped, so augmentation must draw the same again after the resume.
FAST = ("model.name=tests.torch.test_data:flat_net", "model.options={hidden: [32]}",
        "data.options.size=16", "data.batch_size=16", "train.epochs=3", "optim.schedule=constant",
        "optim.warmup_steps=0", "checkpoint.every_steps=7")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return image_folder(tmp_path_factory.mktemp("data") / "images", train=100, test=30, size=16)


def flat_net(spec, hidden=(32,)):
    """An MLP with dropout over flattened images (dropout draws from torch's generator)."""
    from torch import nn
    width = int(np.prod(spec.input_shape))
    return nn.Sequential(nn.Flatten(), nn.Linear(width, hidden[0]), nn.ReLU(), nn.Dropout(0.2),
                         nn.Linear(hidden[0], spec.num_classes))


def run(images, tmp_path, *overrides):
    return train(quiet_config(CONFIG, tmp_path, f"data.options.root={images}", *FAST, *overrides))


def test_workers_and_a_mid_epoch_resume_train_bit_identically(images, tmp_path):
    inline = run(images, tmp_path / "inline", "data.workers=0")
    straight = run(images, tmp_path / "straight", "data.workers=2")
    first = run(images, tmp_path / "resumed", "data.workers=2", "train.max_steps=10")
    assert first.summary["steps"] == 10  # mid-epoch 2: 7 steps per epoch
    resumed = run(images, tmp_path / "resumed", "data.workers=2", "checkpoint.resume=auto")
    assert straight.summary["steps"] == resumed.summary["steps"] == 21
    for key, value in inline.engine.parameters().items():
        assert np.array_equal(straight.engine.parameters()[key], value), key
        assert np.array_equal(resumed.engine.parameters()[key], value), key
    assert straight.summary["data_fingerprint"] == inline.summary["data_fingerprint"]


def test_a_truncated_image_stops_the_run_naming_the_file(images, tmp_path):
    root = tmp_path / "bad"
    shutil.copytree(images, root)
    victim = sorted((root / "train" / "circle").iterdir())[1]
    victim.write_bytes(victim.read_bytes()[:200])
    with pytest.raises(HvdtrainError, match=rf"^cannot read image {victim}: [^\n]+$"):
        run(root, tmp_path / "stop", "data.workers=2")
    with pytest.warns(UserWarning, match=f"skipped cannot read image {victim}.*1 so far"):
        result = run(root, tmp_path / "skip", "data.workers=2", "data.options.skip_corrupt=true")
    assert result.summary["steps"] == 21


def test_a_users_torch_dataset_plugs_in_by_import_path(images, tmp_path):
    result = train(quiet_config(
        CONFIG, tmp_path, "data.name=torch_dataset", "model.name=tests.torch.test_data:flat_net",
        "model.options={}",
        "data.options={train: tests.torch.user_datasets:PillowFolder, "
        f"test: tests.torch.user_datasets:PillowFolder, train_options: {{root: {images}/train}}, "
        f"test_options: {{root: {images}/test}}}}", "data.workers=1", "train.epochs=1"))
    assert result.summary["samples"] == 100
    with pytest.raises(HvdtrainError, match=r"data.options.num_classes: give it"):
        train(quiet_config(CONFIG, tmp_path / "b", "data.name=torch_dataset",
                           "data.options={train: tests.torch.user_datasets:Noise, "
                           "test: tests.torch.user_datasets:Noise}"))
