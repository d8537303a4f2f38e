"""The data formats, augmentation and the loaders' shared logic, without a framework."""

from __future__ import annotations

import hashlib
import mmap
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.data.augment import Augment
from hvdtrain.data.contracts import Draw
from hvdtrain.data.image_folder import ImageFolder
from hvdtrain.data.loading import PlanCursor, Request, fetch, loader_workers
from hvdtrain.data.make_images import SHAPES, make_images
from hvdtrain.data.npy import NpyDataset
from hvdtrain.data.sampler import ShardedSampler
from hvdtrain.errors import HvdtrainError
from tests.image_data import image_folder, npy_copy


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return image_folder(tmp_path_factory.mktemp("data") / "images", train=40, test=20, size=16)


def digest(root):
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(root.rglob("*.jpg")))).hexdigest()


def test_make_images_writes_ten_class_folders_the_same_every_time(images, tmp_path):
    assert sorted(p.name for p in (images / "train").iterdir()) == sorted(SHAPES)
    assert len(list((images / "train").rglob("*.jpg"))) == 40
    assert len(list((images / "test").rglob("*.jpg"))) == 20
    assert digest(make_images(tmp_path / "again", 40, 20, 16)) == digest(images)
    with pytest.raises(HvdtrainError, match="exists and is not empty"):
        make_images(images, 4, 4, 16)


def test_image_folder_decodes_resized_rgb_with_labels_from_sorted_folders(images):
    data = ImageFolder(str(images), size=24)
    assert data.spec().input_shape == (3, 24, 24) and data.spec().num_classes == 10
    batch = data.train().load(np.array([7, 0, 7]))
    assert batch.x.shape == (3, 3, 24, 24) and batch.x.dtype == np.float32
    assert batch.x.min() >= 0.0 and batch.x.max() <= 1.0
    assert np.array_equal(batch.x[0], batch.x[2])
    names = sorted(SHAPES)
    assert [names[label] for label in batch.y] == [
        data.train().paths[i].split("/")[-2] for i in (7, 0, 7)]
    assert data.train().load(np.zeros(0, np.int64)).x.shape == (0, 3, 24, 24)


def test_augmentation_depends_on_seed_epoch_and_index_only():
    augment = Augment(random_crop=2, flip=True)
    x = np.random.default_rng(0).random((5, 3, 8, 8), dtype=np.float32)
    batch = augment.batch(x, np.arange(10, 15), Draw(1, 3))
    alone = augment.batch(x[3:4], np.array([13]), Draw(1, 3))  # another batch, another order
    assert np.array_equal(batch[3], alone[0])
    assert not np.array_equal(batch, augment.batch(x, np.arange(10, 15), Draw(1, 4)))
    assert not np.array_equal(batch, augment.batch(x, np.arange(10, 15), Draw(2, 3)))
    assert batch.shape == x.shape
    with pytest.raises(HvdtrainError, match="need image samples"):
        Augment.from_options(2, False, (64,))


def truncate(path):
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 3])


def test_a_truncated_image_names_the_file_or_is_replaced_deterministically(images, tmp_path):
    root = tmp_path / "bad"
    shutil.copytree(images, root)
    data = ImageFolder(str(root), size=16)
    victim = data.train().paths[5]
    truncate(Path(victim))
    loaded = fetch({"train": data.train()}, Request("train", np.array([4, 5])))
    assert loaded.error.startswith(f"cannot read image {victim}: ") and "\n" not in loaded.error
    skipping = ImageFolder(str(root), size=16, skip_corrupt=True).train()
    batch = skipping.load(np.array([4, 5]))
    assert np.array_equal(batch.x[1], skipping.load(np.array([6])).x[0])  # the next readable
    assert batch.y[1] == skipping.labels[6]
    assert len(batch.skipped) == 1 and victim in batch.skipped[0]


def test_an_empty_class_folder_or_mismatched_classes_fail_before_training(images, tmp_path):
    root = tmp_path / "empty"
    shutil.copytree(images, root)
    for path in (root / "train" / "ring").iterdir():
        path.unlink()
    with pytest.raises(HvdtrainError, match=r"class folder .*train/ring holds no JPG/JPEG/PNG image"):
        ImageFolder(str(root))
    shutil.rmtree(root / "train" / "ring")
    with pytest.raises(HvdtrainError, match="differ from the train split's"):
        ImageFolder(str(root))


MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")  # an smaps entry's first line: its address range


def resident_kb(path: Path) -> int:
    """This process's resident kB of its mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if MAPPING.match(line):
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_npy_is_memory_mapped_scaled_and_checks_shapes(images, tmp_path):
    root = npy_copy(images, tmp_path / "npy", 16)
    data = NpyDataset(str(root), scale=1 / 255)
    assert isinstance(data.train().x.base, mmap.mmap)
    assert data.spec().input_shape == (3, 16, 16) and data.spec().num_classes == 10
    batch = data.train().load(np.array([9, 2, 30]))
    # The rows read are copied out and their pages unmapped: the resident set does not keep them.
    assert resident_kb(root / "train_x.npy") == 0
    assert batch.x.dtype == np.float32 and batch.x.max() <= 1.0
    assert np.allclose(batch.x[1], np.load(root / "train_x.npy")[2] / 255.0)
    np.save(root / "test_x.npy", np.zeros((20, 3, 8, 8), np.uint8))
    with pytest.raises(HvdtrainError,
                       match=r"samples have shape \(3, 16, 16\), test_x.npy samples \(3, 8, 8\)"):
        NpyDataset(str(root))
    np.save(root / "test_x.npy", np.zeros((19, 3, 16, 16), np.uint8))
    with pytest.raises(HvdtrainError, match=r"test_x.npy has 19 samples, test_y.npy 20 labels"):
        NpyDataset(str(root))


def test_a_stream_follows_the_plan_until_a_step_does_not():
    sampler = ShardedSampler(100, 4, accumulation=2, seed=1)
    plan = sampler.steps(3, 1, 2, start=16)
    steps = list(plan)
    cursor = PlanCursor()
    assert not cursor.follows(steps[0])
    requests = cursor.open(steps[0], seed=5)
    assert [r.indices.tolist() for r in requests] == [m.tolist() for s in steps for m in s.micro]
    assert {r.draw for r in requests} == {Draw(5, 3)}
    cursor.advance()
    assert cursor.follows(steps[1]) and not cursor.follows(steps[2])
    again = list(sampler.steps(3, 1, 2, start=16))  # a new plan: a resume or a resize
    assert not cursor.follows(again[1])


def test_loader_workers_default_to_half_the_rank_cores():
    assert loader_workers(0, 1) == 0 and loader_workers(3, 4) == 3
    assert 1 <= loader_workers(-1, 1) <= 8
    assert loader_workers(-1, 10_000) == 1
