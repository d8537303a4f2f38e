"""``data.name=hf_dataset`` in the trainer: an image classification column read from Parquet
trains, and a run stopped mid-epoch resumes bit-identically (the global-batch sampler's exact
resume, as for every source); a missing column stops ``hvdtrain train`` with one line, exit 2."""

from __future__ import annotations

import numpy as np
import pytest

from hvdtrain.cli import main
from hvdtrain.driver import train
from tests.conftest import ROOT, quiet_config

datasets = pytest.importorskip("datasets")
pytest.importorskip("PIL")

CONFIG = ROOT / "configs" / "images_torch.yaml"
FAST = ("model.name=tests.torch.test_data:flat_net", "model.options={hidden: [16]}",
        "data.name=hf_dataset", "data.batch_size=8", "train.epochs=3",
        "optim.schedule=constant", "optim.warmup_steps=0", "checkpoint.every_steps=5")


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
    """64 images of 6x6 pixels in 4 classes (an Image column and a ClassLabel), as Parquet."""
    rng = np.random.default_rng(0)
    labels = np.arange(64) % 4
    pixels = (rng.integers(0, 64, (64, 6, 6, 3)) + 48 * labels[:, None, None, None])
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=list("abcd"))})
    table = datasets.Dataset.from_dict({"image": list(pixels.astype(np.uint8)),
                                        "label": labels.tolist()}, features=features)
    path = tmp_path_factory.mktemp("hf") / "images.parquet"
    table.to_parquet(str(path))
    return path


def run(parquet, tmp_path, *overrides):
    options = (f"data.options={{path: {parquet}, label_column: label, "
               "feature_columns: [image], test_fraction: 0.125}")
    return train(quiet_config(CONFIG, tmp_path, *FAST, options, *overrides))


def test_an_image_column_trains_and_a_mid_epoch_resume_is_bit_identical(parquet, tmp_path):
    straight = run(parquet, tmp_path / "straight")
    first = run(parquet, tmp_path / "resumed", "train.max_steps=10")
    assert first.summary["steps"] == 10  # mid-epoch 2: 56 training images, 7 steps an epoch
    resumed = run(parquet, tmp_path / "resumed", "checkpoint.resume=auto")
    assert straight.summary["steps"] == resumed.summary["steps"] == 21
    for key, value in straight.engine.parameters().items():
        assert np.array_equal(resumed.engine.parameters()[key], value), key
    assert straight.summary["samples"] == 3 * 56  # every image once an epoch
    assert straight.summary["final"] == resumed.summary["final"]


def test_a_missing_column_stops_train_with_one_line_and_exit_2(parquet, tmp_path, capsys):
    code = main(["train", str(CONFIG), f"log.dir={tmp_path / 'run'}", "log.console=false",
                 "log.wandb=disabled", *FAST, f"data.options={{path: {parquet}, "
                 "label_column: label, feature_columns: [pixels]}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "data.options.feature_columns='pixels': no such column (the data has image, label)" \
        in err
