"""Data on disk with TensorFlow: the tf.data pipeline changes nothing that a step trains on (resume
stays bit-identical, and the batches are PyTorch's), and a bad image stops the run naming it."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from hvdtrain.driver import train
from hvdtrain.errors import HvdtrainError
from hvdtrain.tensorflow.engine import TensorFlowEngine  # noqa: F401  (TensorFlow sets its variables on import)
from tests.conftest import ROOT, quiet_config
from tests.image_data import image_folder

CONFIG = ROOT / "configs" / "images_tf.yaml"
FAST = ("model.name=mlp", "model.options={hidden: [32]}", "data.options.size=16",
        "data.batch_size=16", "train.epochs=3", "optim.schedule=constant", "optim.warmup_steps=0",
        "checkpoint.every_steps=7")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return image_folder(tmp_path_factory.mktemp("data") / "images", train=100, test=30, size=16)


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


def test_a_truncated_image_stops_the_run_naming_the_file(images, tmp_path):
    root = tmp_path / "bad"
    shutil.copytree(images, root)
    victim = sorted((root / "test" / "ring").iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:200])
    with pytest.raises(HvdtrainError, match=rf"^cannot read image {victim}: [^\n]+$"):
        run(root, tmp_path / "stop", "data.workers=2")


def test_a_streams_index_batches_go_to_tf_data_as_one_padded_matrix_and_lengths():
    from hvdtrain.data.loading import Request
    from hvdtrain.tensorflow.data import padded_indices

    requests = [Request("train", np.array([5, 3, 9])), Request("train", np.array([7]))]
    padded, lengths = padded_indices(requests)
    assert padded.tolist() == [[5, 3, 9], [7, 0, 0]] and lengths.tolist() == [3, 1]
    padded, lengths = padded_indices([])
    assert padded.shape == (0, 0) and lengths.shape == (0,)
