"""Checkpoint files without a framework: atomic writes, manifests, fallback, pruning, and the
framework-free part of elastic mode (its config for a new world size, the record of indices)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hvdtrain.checkpoint import (
    CheckpointManager,
    atomic_write,
    manifest_path,
    sha256_of,
    verify,
)
from hvdtrain.config import CheckpointConfig, load_config
from hvdtrain.data.sampler import ShardedSampler


def manager(tmp_path, keep: int = 3) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(keep=keep), tmp_path / "checkpoints")


def test_a_failed_write_leaves_neither_the_file_nor_a_temporary(tmp_path):
    def broken(fileobj):
        fileobj.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(tmp_path / "x.ckpt", broken)
    assert list(tmp_path.iterdir()) == []


def test_manifest_holds_the_hash_of_what_was_written_and_old_ones_are_pruned(tmp_path):
    ckpts = manager(tmp_path, keep=2)
    (ckpts.directory / ".step-00000009.ckpt.abc.tmp").parent.mkdir(parents=True)
    (ckpts.directory / ".step-00000009.ckpt.abc.tmp").write_bytes(b"a killed writer's leftover")
    for step in (1, 2, 3):
        ckpts.write(step, lambda f, n=step: [f.write(bytes([n]) * 1000), f.write(b"tail")])
    assert [p.name for p in ckpts.checkpoints()] == ["step-00000002.ckpt", "step-00000003.ckpt"]
    manifest = json.loads(manifest_path(ckpts.path_for(3)).read_text())
    assert manifest == {"file": "step-00000003.ckpt", "sha256": sha256_of(ckpts.path_for(3)),
                        "bytes": 1004, "step": 3}
    assert sorted(p.name for p in ckpts.directory.iterdir()) == [
        "step-00000002.ckpt", "step-00000002.json", "step-00000003.ckpt", "step-00000003.json"]


def test_truncated_flipped_and_unfinished_checkpoints_are_skipped_with_warnings(tmp_path):
    ckpts = manager(tmp_path, keep=5)
    for step in (1, 2, 3, 4):
        ckpts.write(step, lambda f, n=step: f.write(bytes([n]) * 4096))
    path = ckpts.path_for
    path(4).write_bytes(path(4).read_bytes()[:-1])
    flipped = bytearray(path(3).read_bytes())
    flipped[100] ^= 0x10
    path(3).write_bytes(bytes(flipped))
    manifest_path(path(2)).unlink()  # as if killed between the file and its manifest
    with pytest.warns(UserWarning) as caught:
        assert ckpts.latest_valid() == path(1)
    said = [str(w.message) for w in caught]
    assert [s.split(": ", 1)[1] for s in said] == [
        "size differs from the manifest (truncated?)", "sha256 differs from the manifest (corrupted)",
        "no readable manifest (the write did not finish)"]
    assert verify(path(1)) is None


def test_elastic_keep_global_batch_accumulates_what_the_missing_ranks_did():
    from hvdtrain.elastic import world_at
    from hvdtrain.world import World

    cfg = load_config("configs/digits_torch.yaml",
                      ["elastic.enabled=true", "elastic.on_resize=keep_global_batch"], environ={})
    assert world_at(cfg, 2, 2) == World.of(cfg, 2) == World(2, 1, cfg.optim.lr)
    one = world_at(cfg, 2, 1)
    assert one.accumulation == 2
    sampler = ShardedSampler(1437, cfg.data.batch_size, accumulation=one.accumulation)
    assert sampler.step_samples(1) == ShardedSampler(1437, 32).step_samples(2) == 64
    assert one.lr * 1 == pytest.approx(cfg.optim.lr * 2)  # the peak rate of 2 ranks
    with pytest.warns(UserWarning, match="cannot be split evenly over 4 ranks"):
        assert world_at(cfg, 2, 4).accumulation == 1
    scaled = load_config("configs/digits_torch.yaml", [], environ={})
    assert world_at(scaled, 2, 1) == World.of(scaled, 1)  # scale_lr: the schedule follows the size


def test_elastic_index_record_rolls_back_to_the_commit(tmp_path):
    from hvdtrain.data.sampler import StepIndices
    from hvdtrain.elastic import IndexRecord

    record = IndexRecord(enabled=True)
    record.committed = {0: [np.arange(4)]}
    saved = record.snapshot()
    record.add(0, StepIndices(micro=[np.arange(4, 6), np.zeros(0, np.int64)], global_count=2))
    record.committed[0].append(np.arange(4, 6))  # as a commit would
    record.reset_to(saved)
    assert record.pending == {} and [a.tolist() for a in record.committed[0]] == [[0, 1, 2, 3]]
    record.write(tmp_path / "indices")
    assert np.load(tmp_path / "indices" / "epoch-0000.npy").tolist() == [0, 1, 2, 3]
