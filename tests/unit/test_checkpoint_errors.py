"""A checkpoint write that fails (a full disk) leaves nothing behind, keeps the older checkpoints
valid and reaches every rank as the same one-line EnvironmentFailure; run directories that cannot
be written give a one-line error of the right kind."""

from __future__ import annotations

import errno
import json

import pytest

from hvdtrain.checkpoint import (
    CheckpointManager,
    checked_position,
    manifest_path,
    verify,
)
from hvdtrain.config import CheckpointConfig
from hvdtrain.errors import EnvironmentFailure, HvdtrainError
from hvdtrain.rundir import RunDir


class Rank:
    """One rank's engine as the manager sees it, rank 0 called first: ``sent`` holds rank 0's
    collectives, shared by all (the sums of the others are 0 where the manager uses them)."""

    def __init__(self, rank: int, sent: list, fail_after: int | None = None) -> None:
        self.rank, self.sent, self.fail_after = rank, sent, fail_after
        self.collectives = self
        self.calls = 0

    def _collective(self, value):
        self.calls += 1
        if self.rank == 0:
            self.sent.append(value)
        return self.sent[self.calls - 1]

    def broadcast_object(self, obj, root_rank=0):
        return self._collective(obj)

    def allreduce_sums(self, sums):
        return self._collective(sums)

    def gather_state(self):
        pass

    def state_bytes(self, meta):
        return json.dumps(meta).encode() * 100


def failing_write(manager: CheckpointManager, after: int) -> None:
    """Makes the manager's file writes fail with ENOSPC once ``after`` bytes are written."""
    real = manager.write

    def write(step, produce, parts=None):
        def limited(fileobj):
            class Full:
                written = 0

                def write(self, data):
                    Full.written += len(data)
                    if Full.written > after:
                        fileobj.write(bytes(data)[: after // 2])  # a partial file, as a full disk leaves
                        raise OSError(errno.ENOSPC, "No space left on device")
                    return fileobj.write(data)

                def flush(self):
                    fileobj.flush()
            produce(Full())
        return real(step, limited, parts)
    manager.write = write


def test_a_full_disk_stops_every_rank_with_one_line_and_keeps_the_last_checkpoint(tmp_path):
    sent: list = []
    rank0 = CheckpointManager(CheckpointConfig(every_steps=10), tmp_path)
    rank1 = CheckpointManager(CheckpointConfig(every_steps=10), tmp_path / "unused")
    engines = Rank(0, sent), Rank(1, sent)
    for manager, engine in zip((rank0, rank1), engines, strict=True):
        manager.save(engine, engine.rank, 10, {"epoch": 0})
    rank0.wait()
    first = rank0.path_for(10)
    assert verify(first) is None
    failing_write(rank0, after=100)
    for manager, engine in zip((rank0, rank1), engines, strict=True):
        manager.save(engine, engine.rank, 20, {"epoch": 0})
    rank0._pending.join()  # the write behind training has failed by now
    assert rank0.failed() and not rank1.failed()
    # The loop's metrics sum tells every rank; each calls share_failure at the same step.
    errors = []
    for manager, engine in zip((rank0, rank1), engines, strict=True):
        with pytest.raises(EnvironmentFailure) as caught:
            manager.share_failure(engine.collectives, engine.rank)
        errors.append(str(caught.value))
    assert errors[0] == errors[1] == (
        f"cannot write checkpoint {str(rank0.path_for(20))!r}: No space left on device (ENOSPC); "
        "the last valid checkpoint is step-00000010.ckpt; free space (or fix the directory), then "
        "resubmit with checkpoint.resume=auto")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000010.ckpt", "step-00000010.json"]
    assert verify(first) is None and rank0.latest_valid() == first


def test_a_failure_not_yet_shared_is_raised_by_every_rank_at_the_next_save(tmp_path):
    sent: list = []
    rank0 = CheckpointManager(CheckpointConfig(every_steps=10), tmp_path)
    rank1 = CheckpointManager(CheckpointConfig(every_steps=10), tmp_path / "unused")
    failing_write(rank0, after=10)
    engines = Rank(0, sent), Rank(1, sent)
    for manager, engine in zip((rank0, rank1), engines, strict=True):
        manager.save(engine, engine.rank, 10, {})
    for manager, engine in zip((rank0, rank1), engines, strict=True):
        with pytest.raises(EnvironmentFailure, match="no valid checkpoint is left"):
            manager.save(engine, engine.rank, 20, {})
    assert list(tmp_path.iterdir()) == []


def test_a_manifest_that_cannot_be_written_takes_its_checkpoint_with_it(tmp_path, monkeypatch):
    import hvdtrain.checkpoint as checkpoint

    manager = CheckpointManager(CheckpointConfig(), tmp_path)
    real = checkpoint.atomic_write

    def no_room_for_manifests(path, write):
        if path.suffix == ".json":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, write)
    monkeypatch.setattr(checkpoint, "atomic_write", no_room_for_manifests)
    with pytest.raises(OSError):
        manager.write(5, lambda f: f.write(b"x" * 1000))
    assert list(tmp_path.iterdir()) == []


def test_a_run_directory_that_names_a_file_is_a_user_error_naming_it(tmp_path):
    target = tmp_path / "afile"
    target.write_text("")
    for root in (target, target / "below"):
        with pytest.raises(HvdtrainError) as caught:
            RunDir(root).create()
        assert not isinstance(caught.value, EnvironmentFailure)
        assert str(caught.value).startswith(f"log.dir: cannot write the run directory {str(root)!r}")
        assert "log.dir must name a directory" in str(caught.value)


def test_an_unreadable_checkpoint_or_manifest_is_reported_not_raised(tmp_path):
    ckpt = tmp_path / "step-00000001.ckpt"
    ckpt.write_bytes(b"abc")
    manifest_path(ckpt).write_text("[1, 2]")
    assert verify(ckpt) == "the manifest is not an hvdtrain manifest"
    manifest_path(ckpt).write_text(json.dumps({"bytes": 3, "sha256": "0"}))
    ckpt.unlink()
    ckpt.mkdir()
    assert verify(ckpt).startswith("size differs") or verify(ckpt).startswith("cannot be read")


@pytest.mark.parametrize("meta", [None, [], {}, {"position": []}, {"position": {"step": 1}},
                                  {"position": {"step": "1", "epoch": 0, "in_epoch": 0, "samples": 0}},
                                  {"position": {"step": True, "epoch": 0, "in_epoch": 0, "samples": 0}}])
def test_metadata_without_a_training_position_is_not_a_checkpoint(meta):
    with pytest.raises(HvdtrainError, match=r"^checkpoint x is not an hvdtrain checkpoint"):
        checked_position(meta, "checkpoint x")


def test_a_full_position_is_returned():
    meta = {"position": {"step": 3, "epoch": 1, "in_epoch": 32, "samples": 96}, "framework": "torch"}
    assert checked_position(meta, "x") == {"step": 3, "epoch": 1, "in_epoch": 32, "samples": 96}
