"""A manifest's part entry names a file of the checkpoint's directory, never a path (issue 55):
:func:`hvdtrain.checkpoint.part_file` is the one resolution that verifying, pruning and both
frameworks' readers use, so that the file checked against the manifest's sha256 is the file read.
An entry with ``../`` (or an absolute path, or a subdirectory) is refused with one line, even when
a file of that name with the right sha256 lies in the directory (what cutting the entry to its
last component used to check while TensorFlow read the other file). The frameworks' readers are
tested in tests/torch/test_part_paths.py and tests/tensorflow/test_part_paths.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hvdtrain.checkpoint import CheckpointManager, manifest_path, part_file, parts_of, sha256_of, verify
from hvdtrain.config import CheckpointConfig
from hvdtrain.errors import HvdtrainError
from tests.unit.test_checkpoint_parts import save_steps

OUTSIDE = ["../step-00000004.stage-1.part", "{outside}/step-00000004.stage-1.part",
           "sub/step-00000004.stage-1.part", "..", "."]
"""Entries that name no file of the directory (``{outside}``: an absolute directory outside it)."""


def tamper(tmp_path: Path, entry: str) -> tuple[Path, Path]:
    """Two steps saved in parts under tmp_path/ckpt; step 4's manifest (and its state's copy) then
    names part 1 by ``entry``, and a different file of that name lies outside the directory, while
    the genuine part, matching the manifest's sha256, stays inside. Returns step 4's checkpoint
    and the file outside."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    mgr = save_steps(directory, [2, 4], keep=3)
    outside = tmp_path / "step-00000004.stage-1.part"
    outside.write_bytes(b"not what was verified" * 20)
    path = mgr.path_for(4)
    meta = json.loads(path.read_text())  # this fake engine's state: JSON
    meta["parts"][1]["file"] = entry.format(outside=tmp_path)
    path.write_text(json.dumps(meta))
    manifest = json.loads(manifest_path(path).read_text())  # consistent with the new state
    manifest.update(parts=meta["parts"], sha256=sha256_of(path), bytes=path.stat().st_size)
    manifest_path(path).write_text(json.dumps(manifest))
    return path, outside


@pytest.mark.parametrize("entry", OUTSIDE)
def test_a_part_entry_that_names_a_path_fails_verification_and_is_never_read(tmp_path, entry):
    path, outside = tamper(tmp_path, entry)
    named = entry.format(outside=tmp_path)
    assert verify(path) == (f"part {named!r} is not a file name in the checkpoint's directory: "
                            "refused")
    with pytest.raises(HvdtrainError) as info:
        part_file(path.parent, {"file": named}, f"checkpoint {path}")
    assert str(info.value) == (f"checkpoint {path}: part {named!r} is not a file name in the "
                               "checkpoint's directory: refused")
    assert outside not in parts_of(path) and len(parts_of(path)) == 1  # pruning leaves it alone


def test_resume_falls_back_past_a_manifest_that_names_a_path(tmp_path):
    path, outside = tamper(tmp_path, "../step-00000004.stage-1.part")
    mgr = CheckpointManager(CheckpointConfig(keep=3), path.parent)
    with pytest.warns(UserWarning, match=r"step-00000004.ckpt: part '\.\./step-00000004"):
        assert mgr.latest_valid() == mgr.path_for(2)
    mgr._prune(6)  # keep=3: nothing old enough to go, and never the file outside
    assert outside.exists()


def test_a_bare_part_name_resolves_inside_the_directory(tmp_path):
    assert part_file(tmp_path, {"file": "step-00000004.stage-1.part"}, "x") == (
        tmp_path / "step-00000004.stage-1.part")
    for entry in ({}, {"file": 3}, "step-00000004.stage-1.part"):
        with pytest.raises(HvdtrainError, match=r"^x: a part entry names no file$"):
            part_file(tmp_path, entry, "x")
