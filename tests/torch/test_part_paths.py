"""PyTorch reads the very part file that the manifest's sha256 was checked against (issue 55): an
entry naming a path (``../``, absolute) is refused with one line, rather than cut to its last
component, even where the directory holds a genuine part of that name
(:func:`hvdtrain.checkpoint.part_file`; the core's side: tests/unit/test_checkpoint_part_paths.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hvdtrain.checkpoint import sha256_of
from hvdtrain.errors import HvdtrainError
from hvdtrain.torch.parts import merged_parts, part_bytes, read_parts

NAME = "step-00000004.stage-0.part"


def stage_part(directory: Path, value: float) -> dict:
    """A part of one linear layer (weights ``value``) as ``directory/NAME``; its manifest entry."""
    layer = nn.Linear(2, 2)
    nn.init.constant_(layer.weight, value)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    path = directory / NAME
    path.write_bytes(part_bytes([layer], ["0.weight", "0.bias"], optimizer))
    return {"file": NAME, "sha256": sha256_of(path), "bytes": path.stat().st_size,
            "layers": [0]}


@pytest.mark.parametrize("named", ["../" + NAME, "{outside}/" + NAME])
def test_a_part_entry_that_names_a_path_is_refused(tmp_path, named):
    inside = tmp_path / "ckpt"
    inside.mkdir()
    entry = stage_part(inside, 1.0)
    stage_part(tmp_path, 1.0)  # the same bytes outside: cut to its name, the entry would pass
    entry["file"] = named.format(outside=tmp_path)
    where = f"checkpoint {inside / 'step-00000004.ckpt'}"
    expected = (f"{where}: part {entry['file']!r} is not a file name in the checkpoint's "
                "directory: refused")
    for read in (lambda: read_parts(inside, [entry], where),
                 lambda: merged_parts(inside, [entry], ["0.weight", "0.bias"], where)):
        with pytest.raises(HvdtrainError) as info:
            read()
        assert str(info.value) == expected


def test_a_bare_part_name_reads_the_file_in_the_directory(tmp_path):
    inside = tmp_path / "ckpt"
    inside.mkdir()
    entry = stage_part(inside, 3.0)
    stage_part(tmp_path, 5.0)
    [part] = read_parts(inside, [entry], "checkpoint x")
    assert torch.equal(part["model"]["weight"], torch.full((2, 2), 3.0))  # the inside file
