"""Elastic mode at ``shard.stage=3`` in TensorFlow keeps a rank's slices of the parameters in its
commit part (``shard_part(..., params=)``), since any rank may die with them: the parts written
by 3 ranks give each rank of 2 (or 1) exactly its new slices of every variable and slot
(``read_params``, ``read_slots``), as a reset reads them."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from hvdtrain.checkpoint import atomic_write
from hvdtrain.tensorflow.shard_files import layout_of, read_params, read_slots, shard_part
from hvdtrain.tensorflow.shard_grads import UnitShard

SHAPES = [(5, 3), (3,), (3, 2), (2,)]


def _shard(rank: int, size: int) -> UnitShard:
    variables = [keras.Variable(np.zeros(s, np.float32)) for s in SHAPES]
    return UnitShard(variables, [[0, 1], [2, 3]], rank, size, 1 << 20)


def _mine(shard: UnitShard, whole: list[np.ndarray]) -> np.ndarray:
    """This rank's slices of ``whole`` (one array per variable), in the shard variable's order."""
    return np.concatenate([w.reshape(-1)[lo:hi] for w, (lo, hi) in zip(whole, shard.bounds,
                                                                       strict=True)])


@pytest.mark.parametrize("size", [2, 1])
def test_a_commit_of_three_ranks_re_shards_over_fewer(tmp_path, size):
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    slot = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    entries = []
    for rank in range(3):
        shard = _shard(rank, 3)
        label, fields, write = shard_part(shard, {2: _mine(shard, slot)}, rank,
                                          _mine(shard, params))
        path = tmp_path / f"commit-00000001.{label}.part"
        atomic_write(path, write)
        entries.append({"file": path.name, **fields})
    layout = layout_of(_shard(0, 3), {2: np.zeros(1, np.float32)}).to_dict()
    source = {"directory": str(tmp_path), "where": "the elastic commit", "entries": entries,
              "layout": layout, "params": True}
    for rank in range(size):
        shard = _shard(rank, size)
        np.testing.assert_array_equal(read_params(source, shard), _mine(shard, params))
        np.testing.assert_array_equal(read_slots(source, shard, [2])[2], _mine(shard, slot))
