"""The tree helper that carries batches of any structure: leaves in a fixed order, structure kept."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest

from hvdtrain.data import tree
from hvdtrain.errors import HvdtrainError


def test_leaves_visit_dict_keys_sorted_and_sequences_in_order():
    batch = ({"tokens": 1, "mask": 2}, [3, (4,)], None)
    assert tree.leaves(batch) == [2, 1, 3, 4]
    assert [tree.path_name(p) for p, _ in tree.leaves_with_paths(batch)] == [
        "[0]['mask']", "[0]['tokens']", "[1][0]", "[1][1][0]"]
    assert tree.leaves(None) == [] and tree.leaves(7) == [7]


def test_map_keeps_the_structure_and_kind_of_every_node():
    Pair = namedtuple("Pair", "a b")
    mapped = tree.map_tree(lambda v: v * 10, {"x": Pair(1, [2, 3]), "y": None})
    assert mapped == {"x": Pair(10, [20, 30]), "y": None}
    assert isinstance(mapped["x"], Pair) and isinstance(mapped["x"].b, list)
    assert tree.map_tree(lambda a, b: a + b, (1, {"k": 2}), (10, {"k": 20})) == (11, {"k": 22})


def test_unflatten_inverts_leaves():
    like = {"b": (0, 0), "a": [0]}
    assert tree.unflatten(like, [1, 2, 3]) == {"a": [1], "b": (2, 3)}
    with pytest.raises(ValueError, match="more leaves"):
        tree.unflatten(like, [1, 2, 3, 4])


@pytest.mark.parametrize("first, other, message", [
    ({"a": 1}, {"b": 1}, r"keys \['a'\] against \['b'\]"),
    ((1, 2), (1,), "2 items against 1"),
    ((1, None), (1, 2), "None against 2"),
    ({"a": (1,)}, {"a": 1}, r"\[\'a\'\]: structures differ: \(1,\) against 1"),
])
def test_map_names_where_two_structures_differ(first, other, message):
    with pytest.raises(HvdtrainError, match=message):
        tree.map_tree(lambda a, b: a, first, other, where="batch")


def test_stack_makes_one_batch_of_samples_of_any_structure():
    samples = [({"tokens": np.arange(3) + i, "mask": np.ones(3, bool)}, np.int64(i)) for i in range(4)]
    x, y = tree.stack(samples)
    assert x["tokens"].shape == (4, 3) and x["tokens"].dtype == np.int64
    assert x["mask"].dtype == np.bool_ and y.tolist() == [0, 1, 2, 3]
    assert tree.stack([(np.zeros(2), None)] * 3)[1] is None
    with pytest.raises(HvdtrainError, match=r"items: samples of different shapes \[\(2,\), \(3,\)\]"):
        tree.stack([np.zeros(2), np.zeros(3)], "items")


def test_take_and_leading_size_work_on_every_leaf():
    batch = {"a": np.arange(10), "b": (np.arange(20).reshape(10, 2),)}
    picked = tree.take(batch, np.array([7, 2]))
    assert picked["a"].tolist() == [7, 2] and picked["b"][0].tolist() == [[14, 15], [4, 5]]
    assert tree.leading_size(picked) == 2 and tree.leading_size(None) == 0
    assert tree.leading_size(tree.take(batch, np.zeros(0, np.int64))) == 0


def test_describe_gives_dtype_and_shape_of_each_array():
    assert tree.describe(({"m": np.zeros((2, 3), bool)}, np.zeros(2, np.int64), None)) == \
        "({'m': bool[2, 3]}, int64[2], None)"
