"""``shard.stage=3`` in TensorFlow refuses, with one line, the models it cannot run: one with
non-trainable state (batch statistics, a ``Dropout``'s seed generator), which a forward pass
under a ``StatelessScope`` would not update."""

from __future__ import annotations

import keras
import pytest

from hvdtrain.errors import HvdtrainError
from hvdtrain.tensorflow.shard3 import check_model


@pytest.mark.parametrize("layer", [keras.layers.BatchNormalization, lambda: keras.layers.Dropout(
    0.5)])
def test_stage3_refuses_a_model_with_non_trainable_state_in_one_line(layer):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), layer(),
                              keras.layers.Dense(2)])
    with pytest.raises(HvdtrainError) as info:
        check_model(model)
    assert str(info.value).startswith("shard.stage=3 with framework='tensorflow': the model has "
                                      "non-trainable variables") and "\n" not in str(info.value)


def test_stage3_takes_a_model_of_dense_layers():
    check_model(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                  keras.layers.Dense(2)]))
