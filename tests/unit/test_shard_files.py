"""The layout of a checkpoint of shards (hvdtrain/shard_files.py): where a parameter's elements
lie in the parts, the checks of a layout against a model, and the streamed safetensors header."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from hvdtrain.errors import HvdtrainError
from hvdtrain.shard import shard_bounds
from hvdtrain.shard_files import (
    ShardLayout,
    check_fits,
    safetensors_header,
    shard_files,
    tensor_key,
)

UNITS = [[("a", 5), ("b", 6)], [("c", 7)]]
"""Two units of 11 and 7 elements, cut into 3 shards: [4, 4, 3] and [3, 2, 2]."""


def parts_of(layout: ShardLayout, flat: dict[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
    """What each shard's part holds of ``flat`` (each parameter's values, flat)."""
    out: dict[int, dict[str, np.ndarray]] = {}
    for u, unit in enumerate(layout.units):
        whole = np.concatenate([flat[name] for name, _ in unit])
        for shard in range(layout.shards):
            a, b = shard_bounds(whole.size, layout.shards, shard)
            out.setdefault(shard, {})[tensor_key(u, "params")] = whole[a:b]
    return out


def test_reads_find_every_element_of_every_parameter_once():
    layout = ShardLayout(UNITS, 3, 2)
    values = {name: np.arange(size) + 100 * i for i, (name, size) in
              enumerate(p for unit in UNITS for p in unit)}
    parts = parts_of(layout, values)
    for name, size in (p for unit in UNITS for p in unit):
        for lo, hi in ((0, size), (1, size - 1), (2, 3), (size, size)):
            got = np.full(hi - lo, -1)
            for r in layout.reads(name, lo, hi):
                got[r.at:r.at + r.stop - r.start] = parts[r.shard][
                    tensor_key(r.unit, "params")][r.start:r.stop]
            assert np.array_equal(got, values[name][lo:hi]), (name, lo, hi)
    assert layout.shard_lengths(2) == [3, 2]
    with pytest.raises(ValueError):
        layout.reads("a", 0, 6)


def test_a_layout_round_trips_and_a_damaged_one_is_one_line():
    layout = ShardLayout(UNITS, 3, 2, {"a": [5], "b": [2, 3], "c": [7]}, {"exp_avg": "F32"},
                         [{"step": 3}, {"step": 3}], {"head": "a"})
    again = ShardLayout.from_dict(layout.to_dict(), "x")
    assert again.to_dict() == layout.to_dict() and again.unit_of("c") == 1
    with pytest.raises(HvdtrainError, match=r"^ckpt: its layout of shards is damaged"):
        ShardLayout.from_dict({"units": UNITS}, "ckpt")


def test_a_model_that_does_not_fit_and_a_missing_shard_are_one_line_errors():
    layout = ShardLayout(UNITS, 2, 3)
    check_fits(layout, [("c", 7), ("a", 5), ("b", 6)], "ckpt")
    with pytest.raises(HvdtrainError, match=r"ckpt does not fit the model: .*missing \['d'\]"):
        check_fits(layout, [("a", 5), ("b", 6), ("c", 7), ("d", 1)], "ckpt")
    with pytest.raises(HvdtrainError, match=r"sizes differ at \['c'\]"):
        check_fits(layout, [("a", 5), ("b", 6), ("c", 8)], "ckpt")
    entries = [{"file": "p0", "shard": 0}, {"file": "p0b", "shard": 0}, {"file": "p1", "shard": 1}]
    assert {s: e["file"] for s, e in shard_files(entries, layout, "ckpt").items()} == {
        0: "p0", 1: "p1"}  # the first of a shard's replicas
    with pytest.raises(HvdtrainError, match=r"^ckpt: no part holds shard\(s\) \[1\] of 2$"):
        shard_files(entries[:1], layout, "ckpt")


def test_a_streamed_file_is_a_safetensors_file(tmp_path):
    tensors = {"u0.params": np.arange(5, dtype=np.float32), "u1.params": np.zeros(0, np.float32),
               "m": np.ones((2, 3), dtype=np.float64)}
    header = safetensors_header([(k, "F32" if v.dtype == np.float32 else "F64", v.shape, v.nbytes)
                                 for k, v in tensors.items()], {"format": "pt"})
    assert len(header) % 8 == 0
    path = tmp_path / "x.safetensors"
    path.write_bytes(header + b"".join(v.tobytes() for v in tensors.values()))
    got = load_file(str(path))
    assert got.keys() == tensors.keys()
    for key, value in tensors.items():
        assert np.array_equal(got[key], value) and got[key].dtype == value.dtype
