"""The data contract for batches of any structure: the spec says what a sample holds without
presuming classes, in-memory splits carry trees of arrays (or no targets), empty batches keep
their structure, and classification stays the short path."""

from __future__ import annotations

import numpy as np
import pytest

from hvdtrain.adapters import classes_and_shape
from hvdtrain.data import tree
from hvdtrain.data.contracts import LABELS, ArraySpec, Batch, DatasetSpec, Split
from hvdtrain.data.loading import Request, fetch
from hvdtrain.data.sampler import ShardedSampler
from hvdtrain.errors import HvdtrainError

T = 5


def language_split(n: int, targets: bool = True) -> Split:
    """``n`` sequences of ``T`` token ids with a mask, and their next tokens."""
    tokens = np.arange(n * (T + 1), dtype=np.int64).reshape(n, T + 1) % 11
    x = {"tokens": tokens[:, :-1], "mask": tokens[:, :-1] > 0}
    return Split(x, tokens[:, 1:] if targets else None)


def test_classification_is_the_short_path():
    spec = DatasetSpec(input_shape=(64,), num_classes=10)
    assert spec.inputs == ArraySpec((64,), "float32") and spec.targets == LABELS
    assert spec.input_shape == (64,) and classes_and_shape(spec, "mlp") == (10, (64,))
    empty = spec.empty()
    assert empty.x.shape == (0, 64) and empty.x.dtype == np.float32
    assert empty.y.shape == (0,) and empty.y.dtype == np.int64


def test_a_spec_of_any_structure_says_what_a_model_needs_without_classes():
    spec = DatasetSpec(inputs={"tokens": ArraySpec((T,), "int64"), "mask": ArraySpec((T,), np.bool_)},
                       targets=ArraySpec([T], "int64"))
    assert spec.num_classes is None and spec.input_shape is None
    assert spec.inputs["mask"].dtype == "bool" and spec.targets.shape == (T,)
    assert DatasetSpec.of(language_split(4)) == spec
    single = DatasetSpec(inputs=ArraySpec((T,), "int64"), targets=None)
    assert single.input_shape == (T,) and single.targets is None
    with pytest.raises(HvdtrainError, match=r"model mlp is a classifier: it needs one float input array "
                       r"and num_classes; the dataset gives inputs \{'mask': bool\[5\], "
                       r"'tokens': int64\[5\]\} and no num_classes"):
        classes_and_shape(spec, "mlp")
    tokens = DatasetSpec(inputs=ArraySpec((T,), "int64"), num_classes=256)  # a text corpus
    with pytest.raises(HvdtrainError, match=r"the dataset gives inputs int64\[5\] and 256 classes"):
        classes_and_shape(tokens, "mlp")


@pytest.mark.parametrize("fields, message", [
    ({}, r"DatasetSpec.inputs=None: .* give inputs or input_shape"),
    ({"inputs": ((8,), "int64")},
     r"DatasetSpec.inputs\[0\]\[0\]: expected an ArraySpec\(shape, dtype\), got 8"),
    ({"inputs": ArraySpec((2,)), "targets": {"a": None}},
     r"DatasetSpec.targets=\{'a': None\}: .* None only as the whole targets"),
    ({"input_shape": (3,), "inputs": ArraySpec((4,))},
     r"input_shape=\(3,\) does not match inputs=float32\[4\]"),
    ({"input_shape": (3,), "num_classes": 0}, r"num_classes=0: expected a positive integer or None"),
])
def test_a_wrong_spec_is_refused_naming_the_field(fields, message):
    with pytest.raises(HvdtrainError, match=message):
        DatasetSpec(**fields)


def test_an_array_spec_normalises_its_fields_and_refuses_an_unknown_dtype():
    assert ArraySpec([3, None], np.dtype("<i8")) == ArraySpec((3, None), "int64")
    with pytest.raises(HvdtrainError, match=r"ArraySpec\(shape=\(2,\), dtype='no-such-type'\): data type"):
        ArraySpec((2,), "no-such-type")


def test_a_split_of_trees_loads_by_index_and_empty_indices_give_the_structure():
    split = language_split(6)
    batch = split.load(np.array([4, 1]))
    assert len(split) == 6 and batch.x["tokens"].tolist() == split.x["tokens"][[4, 1]].tolist()
    assert np.array_equal(batch.y, split.y[[4, 1]])
    empty = split.load(np.zeros(0, np.int64))
    assert tree.describe((empty.x, empty.y)) == "({'mask': bool[0, 5], 'tokens': int64[0, 5]}, int64[0, 5])"
    spec = DatasetSpec.of(split)
    assert tree.describe((spec.empty().x, spec.empty().y)) == tree.describe((empty.x, empty.y))
    spec.check(empty, 0, "test")


def test_a_split_without_targets_and_one_of_tuples():
    split = language_split(3, targets=False)
    assert split.load(np.array([2])).y is None and DatasetSpec.of(split).targets is None
    pairs = Split((np.zeros((3, 2), np.float32), np.ones((3, 4), np.int32)), (np.arange(3),))
    loaded = pairs.load(np.array([0, 2]))
    assert isinstance(loaded.x, tuple) and loaded.x[1].dtype == np.int32 and loaded.y[0].tolist() == [0, 2]
    assert DatasetSpec.of(pairs).empty().x[1].shape == (0, 4)


def test_a_split_whose_arrays_differ_in_length_is_refused():
    with pytest.raises(HvdtrainError, match="dataset split has 3 inputs but 4 labels"):
        Split(np.zeros((3, 2)), np.zeros(4))
    with pytest.raises(HvdtrainError, match=r"arrays differ in length: x\['mask'\] 3, x\['tokens'\] 2"):
        Split({"tokens": np.zeros((2, 1)), "mask": np.zeros((3, 1))})
    with pytest.raises(HvdtrainError, match="no input arrays"):
        Split({}, np.zeros(3))


def test_check_names_the_array_that_does_not_fit_the_spec():
    spec = DatasetSpec.of(language_split(2))
    good = language_split(2).load(np.array([0, 1]))
    spec.check(good, 2, "a batch")
    wrong_dtype = Batch({**good.x, "tokens": good.x["tokens"].astype(np.int32)}, good.y)
    with pytest.raises(HvdtrainError, match=r"a batch: inputs\['tokens'\] has int32\[5\] a sample, "
                       r"the dataset's spec says int64\[5\]"):
        spec.check(wrong_dtype, 2, "a batch")
    with pytest.raises(HvdtrainError, match=r"a batch: inputs\['mask'\] has 2 samples, not 3"):
        spec.check(good, 3, "a batch")
    with pytest.raises(HvdtrainError, match=r"a batch: targets has 1 samples, not 2"):
        spec.check(Batch(good.x, good.y[:1]), 2, "a batch")
    with pytest.raises(HvdtrainError, match=r"a batch: inputs: structures differ: keys"):
        spec.check(Batch({"tokens": good.x["tokens"]}, good.y), 2, "a batch")
    with pytest.raises(HvdtrainError, match=r"a batch: targets: structures differ: None against int64"):
        DatasetSpec.of(language_split(2, targets=False)).check(good, 2, "a batch")


def test_a_varying_size_fits_any_and_is_empty_as_zero():
    spec = ArraySpec((None, 3), "float32")
    assert spec.mismatch(np.zeros((2, 7, 3), np.float32)) == ""
    assert spec.mismatch(np.zeros((2, 7, 4), np.float32)) != ""
    assert spec.empty().shape == (0, 0, 3)


def test_every_sample_of_any_structure_travels_through_the_sampler_once_an_epoch():
    split = language_split(5)  # the second micro-batch of 8 leaves rank 1 none
    sampler = ShardedSampler(len(split), batch_size=2, accumulation=2, seed=3)
    seen, empty = [], 0
    for rank in range(2):
        for step in sampler.steps(epoch=1, rank=rank, world_size=2):
            for micro in step.micro:
                loaded = fetch({"train": split}, Request("train", micro))
                DatasetSpec.of(split).check(Batch(loaded.x, loaded.y), len(micro), "train")
                assert np.array_equal(loaded.y, split.y[micro])
                seen += loaded.x["tokens"][:, 0].tolist()
                empty += len(micro) == 0
    assert sorted(seen) == sorted(split.x["tokens"][:, 0].tolist()) and empty > 0
