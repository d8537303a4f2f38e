"""Run by test_tf_scatter.py under ``horovodrun -np 2``: hvdtrain's TensorFlow
``grouped_reducescatter`` in rounds against Horovod's in one call, eagerly and in a
``tf.function``; prints one ``{"rank": ...}`` line."""

import json

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdtrain.tensorflow import collectives

hvd.init()
collectives.SCATTER_PIECE = 1000  # rounds on small tensors: the path a 20 M tensor takes
SIZES = (10, 5003, 7, 2001, 2000, 1)
rng = np.random.default_rng(hvd.rank())
flats = [tf.constant(rng.standard_normal(n).astype(np.float32)) for n in SIZES]
whole = hvd.grouped_reducescatter(flats, op=hvd.Average)
eager = collectives.grouped_reducescatter(flats, op=hvd.Average)
traced = tf.function(lambda xs: collectives.grouped_reducescatter(xs, op=hvd.Average))(flats)
print(json.dumps({
    "rank": hvd.rank(),
    "shapes": [int(t.shape[0]) for t in eager],
    "whole_shapes": [int(t.shape[0]) for t in whole],
    "eager_equal": all(bool(np.array_equal(a.numpy(), b.numpy()))
                       for a, b in zip(eager, whole, strict=True)),
    "traced_equal": all(bool(np.array_equal(a.numpy(), b.numpy()))
                        for a, b in zip(traced, whole, strict=True)),
}), flush=True)
