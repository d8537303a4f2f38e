"""Checkpoints written in parts (pipeline stages) without a framework: part names, the manifest
that commits them, verification of every part, pruning with orphans, a failed part stopping every
rank, and which parts a rank of another split reads.

The ranks are threads of this process whose collectives meet at a barrier: the manager's own logic
(the allgather as the barrier before the manifest, the failure shared by all) is what is tested.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest

from hvdtrain.checkpoint import CheckpointManager, manifest_path, parts_of, sha256_of, verify
from hvdtrain.config import CheckpointConfig
from hvdtrain.engine import PartedState
from hvdtrain.errors import HvdtrainError
from hvdtrain.pipeline.state import merge_parts, parts_holding, parts_misfit


class ThreadWorld:
    """Collectives of ``size`` ranks that are threads: each call meets the others at a barrier."""

    def __init__(self, size: int) -> None:
        self.size, self.barrier = size, threading.Barrier(size, timeout=30)
        self.slots: list[Any] = [None] * size

    def gather(self, rank: int, obj: Any) -> list[Any]:
        self.barrier.wait()
        self.slots[rank] = obj
        self.barrier.wait()
        result = list(self.slots)
        self.barrier.wait()
        return result


class Stage(PartedState):
    """One rank of a pipeline of ``size`` stages: stage ``rank`` holds layers ``2 rank`` and
    ``2 rank + 1``."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self.rank, self.collectives = world, rank, self

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.world.gather(self.rank, obj)

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        return self.world.gather(self.rank, obj)[root_rank]

    def allreduce_sums(self, sums: dict[str, float]) -> dict[str, float]:
        every = self.world.gather(self.rank, sums)
        return {key: sum(s[key] for s in every) for key in sums}

    def part_bytes(self) -> tuple[str, list[int], bytes] | None:
        return f"stage-{self.rank}", [2 * self.rank, 2 * self.rank + 1], bytes([self.rank]) * 300

    def state_bytes(self, meta: dict[str, Any]) -> bytes:
        return json.dumps(meta).encode()


def on_ranks(size: int, func: Callable[[Stage], Any]) -> list[Any]:
    """``func(stage)`` on ``size`` thread ranks; each rank's result or exception, in rank order."""
    world, results = ThreadWorld(size), [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = func(Stage(world, rank))
        except BaseException as exc:  # noqa: BLE001  (returned for the test to look at)
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def save_steps(directory, steps, keep: int = 2) -> CheckpointManager:
    managers = {}

    def save(stage: Stage) -> None:
        mgr = managers.setdefault(stage.rank, CheckpointManager(
            CheckpointConfig(keep=keep), directory))
        for step in steps:
            mgr.save(stage, stage.rank, step, {"position": {"step": step}})
        mgr.wait()

    assert on_ranks(2, save) == [None, None]
    return managers[0]


def test_parts_are_named_by_step_and_stage_and_the_manifest_lists_them(tmp_path):
    mgr = save_steps(tmp_path, [4])
    assert mgr.part_path(12, "stage-1").name == "step-00000012.stage-1.part"
    manifest = json.loads(manifest_path(mgr.path_for(4)).read_text())
    assert [p["file"] for p in manifest["parts"]] == ["step-00000004.stage-0.part",
                                                      "step-00000004.stage-1.part"]
    for rank, part in enumerate(manifest["parts"]):
        assert part["layers"] == [2 * rank, 2 * rank + 1]
        assert part["bytes"] == 300 and part["sha256"] == sha256_of(tmp_path / part["file"])
    meta = json.loads(mgr.path_for(4).read_text())  # the state rank 0 wrote lists them too
    assert meta["parts"] == manifest["parts"] and meta["step"] == 4
    assert verify(mgr.path_for(4)) is None
    assert parts_of(mgr.path_for(4)) == [tmp_path / p["file"] for p in manifest["parts"]]


def test_keep_prunes_parts_with_their_checkpoint_and_orphans_that_got_no_manifest(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "step-00000003.stage-0.part").write_bytes(b"a save killed before its manifest")
    (tmp_path / ".step-00000003.stage-1.part.x.tmp").write_bytes(b"a writer killed mid-write")
    mgr = save_steps(tmp_path, [2, 4, 6])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000004.ckpt", "step-00000004.json", "step-00000004.stage-0.part",
        "step-00000004.stage-1.part", "step-00000006.ckpt", "step-00000006.json",
        "step-00000006.stage-0.part", "step-00000006.stage-1.part"]
    assert mgr.latest_valid() == mgr.path_for(6)


@pytest.mark.parametrize("damage, problem", [
    (lambda p: p.write_bytes(p.read_bytes()[:-1]), "size differs"),
    (lambda p: p.write_bytes(b"\x07" + p.read_bytes()[1:]), "sha256 differs"),
    (lambda p: p.unlink(), "size differs"),
])
def test_a_damaged_or_missing_part_fails_verification_and_resume_falls_back(tmp_path, damage,
                                                                           problem):
    mgr = save_steps(tmp_path, [2, 4], keep=3)
    damage(mgr.part_path(4, "stage-1"))
    assert verify(mgr.path_for(4)) == f"part step-00000004.stage-1.part: {problem} from the " \
        f"manifest{' (truncated?)' if problem == 'size differs' else ' (corrupted)'}"
    with pytest.warns(UserWarning, match="stage-1.part"):
        assert mgr.latest_valid() == mgr.path_for(2)


def test_a_part_that_cannot_be_written_stops_every_rank_and_commits_nothing(tmp_path):
    save_steps(tmp_path, [2], keep=3)
    (tmp_path / "step-00000004.stage-1.part").mkdir()  # rank 1's rename onto it fails

    def save(stage: Stage) -> None:
        CheckpointManager(CheckpointConfig(keep=3), tmp_path).save(stage, stage.rank, 4, {})

    errors = on_ranks(2, save)
    assert all(isinstance(e, HvdtrainError) for e in errors), errors
    assert str(errors[0]) == str(errors[1])
    assert "step-00000004.stage-1.part" in str(errors[0]) and "\n" not in str(errors[0])
    assert not (tmp_path / "step-00000004.stage-0.part").exists()  # rank 0 took its part back
    assert not (tmp_path / "step-00000004.json").exists()
    assert not (tmp_path / "step-00000004.ckpt").exists()
    assert verify(tmp_path / "step-00000002.ckpt") is None  # the one before stays valid


def test_a_rank_of_another_split_reads_only_the_parts_that_hold_its_layers():
    parts = [{"file": "a", "layers": [0, 1, 2]}, {"file": "b", "layers": [3, 4]},
             {"file": "c", "layers": [5]}]
    assert [p["file"] for p in parts_holding(parts, {2, 3})] == ["a", "b"]
    assert [p["file"] for p in parts_holding(parts, range(6))] == ["a", "b", "c"]
    assert [p["file"] for p in parts_holding(parts, {5})] == ["c"]
    assert parts_misfit(parts, 6) is None
    assert "the model has 7" in parts_misfit(parts, 7)
    assert "9 in all" in parts_misfit(parts[:1] + parts, 6)


def test_a_checkpoint_file_that_cannot_be_written_takes_its_parts_with_it(tmp_path):
    mgr = CheckpointManager(CheckpointConfig(keep=3), tmp_path)
    tmp_path.joinpath("step-00000004.stage-0.part").write_bytes(b"written before the failure")

    def full_disk(fileobj):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        mgr.write(4, full_disk, [{"file": "step-00000004.stage-0.part"}])
    assert list(tmp_path.iterdir()) == []


def test_parts_of_another_model_do_not_merge():
    part = {"model": {"0.weight": 1}, "params": ["0.weight", "5.weight"],
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}}
    with pytest.raises(ValueError, match=r"parameter '5\.weight', which the model lacks"):
        merge_parts([part], ["0.weight"])
