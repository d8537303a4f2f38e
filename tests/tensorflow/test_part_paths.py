"""TensorFlow reads the very part file that the manifest's sha256 was checked against (issue 55):
it used to read ``directory / entry["file"]`` while verifying checked the entry cut to its last
component, so an entry with ``../`` was checked against one file and loaded from another. Now an
entry naming a path (``../``, absolute) is refused with one line
(:func:`hvdtrain.checkpoint.part_file`; the core's side: tests/unit/test_checkpoint_part_paths.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.checkpoint import sha256_of
from hvdtrain.errors import HvdtrainError
from hvdtrain.tensorflow.parts import part_bytes, read_parts

NAME = "step-00000004.stage-0.part"
ENTRY = "model/0.0"


def stage_part(directory: Path, value: float) -> dict:
    """A part holding one variable (``value``) as ``directory/NAME``; its manifest entry."""
    path = directory / NAME
    path.write_bytes(part_bytes({ENTRY: tf.Variable(np.full(3, value, np.float32))}))
    return {"file": NAME, "sha256": sha256_of(path), "bytes": path.stat().st_size,
            "layers": [0]}


@pytest.mark.parametrize("named", ["../" + NAME, "{outside}/" + NAME])
def test_a_part_entry_that_names_a_path_is_refused(tmp_path, named):
    inside = tmp_path / "ckpt"
    inside.mkdir()
    stage_part(inside, 1.0)  # the genuine part, which verifying the entry cut to its name checked
    entry = stage_part(tmp_path, 9.0)  # another file, whose sha256 the entry carries
    entry["file"] = named.format(outside=tmp_path)
    where = f"checkpoint {inside / 'step-00000004.ckpt'}"
    with pytest.raises(HvdtrainError) as info:
        read_parts(inside, [entry], [ENTRY], where)
    assert str(info.value) == (f"{where}: part {entry['file']!r} is not a file name in the "
                               "checkpoint's directory: refused")


def test_a_bare_part_name_reads_the_file_in_the_directory(tmp_path):
    inside = tmp_path / "ckpt"
    inside.mkdir()
    entry = stage_part(inside, 3.0)
    stage_part(tmp_path, 5.0)
    values, state = read_parts(inside, [entry], [ENTRY], "checkpoint x")
    assert np.array_equal(values[ENTRY], np.full(3, 3.0, np.float32)) and state == {}
