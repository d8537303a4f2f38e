"""The TensorFlow pipeline's pieces in one process: stages built from the adapter's layers start
from the whole model's weights whatever the split, the classifier's output_loss is its loss, and
what the TensorFlow stages do not run is refused."""

from __future__ import annotations

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.checkpoint import sha256_of
from hvdtrain.compression.state import by_index, by_name, merge_named, pack
from hvdtrain.data.contracts import DatasetSpec
from hvdtrain.errors import HvdtrainError
from hvdtrain.pipeline.split import balanced_bounds
from hvdtrain.tensorflow import parts, pipeline
from hvdtrain.tensorflow.models import MLP

SPEC = DatasetSpec(input_shape=(8, 8), num_classes=10)


def whole_model(adapter: MLP, seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)  # as the TensorFlow engine builds rank 0's model
    return adapter.build(SPEC)


@pytest.mark.parametrize("bounds", [[0, 1, 4], [0, 2, 4], [0, 3, 4], [0, 1, 2, 3, 4]])
def test_stages_hold_the_whole_models_initial_weights(bounds):
    adapter = MLP(hidden=[16, 12])
    whole = [v.numpy() for v in whole_model(adapter, 3).trainable_variables]
    factories = adapter.layers(SPEC)
    assert [f.name for f in factories] == ["flatten", "fc1", "fc2", "head"]
    made = pipeline.make_layers(factories, 3)
    costs, inputs = pipeline.measure(made, (8, 8), "float32")
    assert costs == [0, 64 * 16 + 16, 16 * 12 + 12, 12 * 10 + 10]
    assert inputs == [((8, 8), "float32"), ((64,), "float32"), ((16,), "float32"),
                      ((12,), "float32")]
    got = []
    for lo, hi in itertools.pairwise(bounds):  # each stage built alone, as its rank does
        own = pipeline.make_layers(adapter.layers(SPEC), 3)[lo:hi]
        model = pipeline.stage_model(own, *inputs[lo])
        got += [v.numpy() for v in model.trainable_variables]
    assert len(got) == len(whole)
    for mine, theirs in zip(got, whole, strict=True):
        assert np.array_equal(mine, theirs)


def test_auto_split_balances_parameters():
    made = pipeline.make_layers(MLP(hidden=[16, 12]).layers(SPEC), 0)
    costs, _ = pipeline.measure(made, (8, 8), "float32")
    assert balanced_bounds(costs, 2) == [0, 2, 4]  # fc1 (1,040) against fc2 + head (334)


def test_output_loss_is_the_classifiers_loss():
    adapter = MLP(hidden=[16])
    model = whole_model(adapter, 0)
    x = tf.random.stateless_normal([5, 8, 8], seed=[1, 2])
    y = tf.constant([0, 3, 9, 3, 1], tf.int64)
    loss, metrics = adapter.loss_and_metrics(model, x, y, training=False)
    out_loss, out_metrics = adapter.output_loss(model(x, training=False), y, training=False)
    assert float(out_loss) == pytest.approx(float(loss)) and set(out_metrics) == {"correct"}
    assert float(out_metrics["correct"]) == float(metrics["correct"])


def test_schedules_the_tensorflow_stages_do_not_run_are_refused():
    pipeline.check_schedule("1f1b")
    pipeline.check_schedule("gpipe")
    with pytest.raises(HvdtrainError, match=r"interleaved_1f1b'.*runs gpipe and 1f1b"):
        pipeline.check_schedule("interleaved_1f1b")


def test_a_stage_output_of_unknown_size_is_refused():
    with pytest.raises(HvdtrainError, match="fixed sample shape"):
        pipeline.describe((None, 4), "float32")


def test_keras_variables_and_adam_slots_are_named_by_global_layer():
    """A checkpoint part's keys: the split-free names of a stage's variables and its slots."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    named = parts.named_state(model.layers, 5, optimizer)
    slots = [f"optimizer/{k}.{j}/{s}" for k, j in [(5, 0), (5, 1), (6, 0), (6, 1), (7, 0), (7, 1)]
             for s in ("momentum", "velocity")]
    assert sorted(named) == sorted(
        [f"model/{k}.{j}" for k, n in [(5, 2), (6, 4), (7, 2)] for j in range(n)]
        + slots + ["optimizer/opt/iteration", "optimizer/opt/learning_rate"])
    assert named["optimizer/7.0/velocity"].shape == model.layers[2].kernel.shape
    assert named["model/6.2"] is model.layers[1].moving_mean


def test_trainable_variables_are_named_by_global_layer():
    """The exchange's tensors by the parts' names: batch norm's moving statistics (its variables
    2 and 3) do not train; a variable outside the layers given leaves no names."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    names = parts.trainable_names(model.layers, 5, model.trainable_variables)
    assert names == ["5.0", "5.1", "6.0", "6.1", "7.0", "7.1"]
    assert parts.trainable_names(model.layers[1:], 6, model.trainable_variables) is None


def test_a_part_holds_the_exchange_state_by_name(tmp_path):
    """A part's exchange state (slots by variable name) reads back apart from its entries, and
    a stage takes its own slots from it by its variables' names."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD()
    optimizer.build(model.trainable_variables)
    entries = parts.named_state(model.layers, 1, optimizer)
    names = parts.trainable_names(model.layers, 1, model.trainable_variables)
    rows = np.arange(24, dtype=np.float32).reshape(2, 12)
    state = by_name(pack("topk", 7, {"residual/2": rows[:, :6]}), names)
    path = tmp_path / "step-7.stage-1.part"
    path.write_bytes(parts.part_bytes(entries, state))
    found, read = parts.read_part(path, entries, "the part", sha256_of(path))
    assert found.keys() == entries.keys()
    np.testing.assert_array_equal(found["model/2.0"], model.layers[1].kernel.numpy())
    assert read.keys() == {"method", "step", "residual/2.0"}
    np.testing.assert_array_equal(read["residual/2.0"], rows[:, :6])
    # A stage holding layer 2 alone: its kernel is its exchange's tensor 0.
    mine = by_index(merge_named([read], "the part"), ["2.0", "2.1"])
    assert mine is not None and set(mine) == {"method", "step", "residual/0"}
    assert parts.read_compression(path, "the part").keys() == read.keys()


def test_a_checkpoint_without_exchange_state_reads_as_none(tmp_path):
    path = tmp_path / "step-1.stage-0.part"
    path.write_bytes(parts.part_bytes({}))
    assert parts.read_compression(path, "the part") == {}
