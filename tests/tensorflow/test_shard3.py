"""``shard.stage=3`` in TensorFlow refuses, with one line, the models it cannot run: one with
non-trainable state (batch statistics, a ``Dropout``'s seed generator), which a forward pass
under a ``StatelessScope`` would not update. It builds a model a variable at a time, each cut to
the rank's slice as it is made (:func:`build_in_slices`): the slices are those of the whole
model built with the same seed, and building never holds the model whole (peak resident memory
measured in a process of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from hvdtrain.errors import HvdtrainError
from hvdtrain.shard import shard_bounds
from hvdtrain.tensorflow.shard3 import build_in_slices, check_model


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


def _mlp() -> keras.Model:
    return keras.Sequential([keras.Input((7,)), keras.layers.Dense(5, activation="relu"),
                             keras.layers.Dense(3)])


def test_built_in_slices_the_ranks_hold_the_seeded_model_between_them_and_none_of_it_whole():
    keras.utils.set_random_seed(11)
    whole = [v.numpy().reshape(-1) for v in _mlp().trainable_variables]
    sliced = [build_in_slices(_mlp, 11, rank, 3) for rank in range(3)]
    for model, _ in sliced:
        assert [tuple(v.shape) for v in model.trainable_variables] == [(7, 5), (5,), (5, 3), (3,)]
        assert [int(np.size(v.value)) for v in model.trainable_variables] == [0, 0, 0, 0]
    for i, flat in enumerate(whole):
        for rank, (_, slices) in enumerate(sliced):  # each rank its own range, 7 x 5 = 12+12+11
            lo, hi = shard_bounds(flat.size, 3, rank)
            np.testing.assert_array_equal(slices[i], flat[lo:hi])


PEAK = """
import gc, json, os, sys
from pathlib import Path
from hvdtrain.malloc import return_freed_blocks
return_freed_blocks()
import keras
from hvdtrain.tensorflow.shard3 import build_in_slices

def model():  # 16 variables of 2,048 x 2,048 floats (16 MiB each, 256 MiB)
    return keras.Sequential([keras.Input((2048,)), *(keras.layers.Dense(2048, use_bias=False)
                                                      for _ in range(16))])

def rise(build):  # MiB of peak resident memory above the start while build() runs
    gc.collect()
    status = lambda key: next(int(l.split()[1]) for l in Path("/proc/self/status").read_text()
                              .splitlines() if l.startswith(key)) / 1024
    Path("/proc/self/clear_refs").write_text("5")
    start = status("VmRSS:")
    kept = build()
    return status("VmHWM:") - start

keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])  # the runtime's first allocations
print(json.dumps({"sliced": rise(lambda: build_in_slices(model, 0, 7, 8)), "whole": rise(model)}))
"""


def test_building_in_slices_peaks_far_below_the_whole_model():
    """At 8 ranks a rank keeps 32 MiB of the 256 MiB model; it builds with one variable whole at
    a time beside its slices, where a plain build holds all 256 MiB."""
    env = {**os.environ, "TF_ONEDNN_USE_SYSTEM_ALLOCATOR": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rise = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rise["whole"] > 240, rise  # the measure sees a whole model
    assert rise["sliced"] < 0.5 * 256, rise
