"""Synchronized batch norm at N ranks against one process on the global batch.

Usage (under horovodrun): syncbn_worker.py OUT_DIR FRAMEWORK
Every rank draws the same global batch (fixed seed), feeds its share (every size-th sample from its
rank on) to a synchronized batch-norm layer in training mode, and writes OUT_DIR/rank<r>.npz with
the layer's output on its share, its running statistics after that step, and the same from a plain
batch-norm layer that this rank fed the whole global batch.
"""

import sys
from pathlib import Path

import numpy as np

GLOBAL, CHANNELS = 12, 3


def batch() -> np.ndarray:
    return np.random.default_rng(7).normal(2.0, 3.0, (GLOBAL, CHANNELS, 4, 4)).astype(np.float32)


def run_torch() -> tuple[int, int, dict[str, np.ndarray]]:
    import horovod.torch as hvd
    import torch

    from hvdtrain.torch.syncbn import convert
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x = torch.from_numpy(batch())
    plain = torch.nn.BatchNorm2d(CHANNELS, momentum=0.5)
    synced = convert(torch.nn.Sequential(torch.nn.BatchNorm2d(CHANNELS, momentum=0.5)), torch.device("cpu"))
    full = plain(x)
    part = synced(x[rank::size])
    part.sum().backward()  # the backward pass runs the gradient's allreduces on every rank
    bn = synced[0]
    return rank, size, {"out": part.detach().numpy(), "expected_out": full[rank::size].detach().numpy(),
                        "mean": bn.running_mean.numpy(), "expected_mean": plain.running_mean.numpy(),
                        "var": bn.running_var.numpy(), "expected_var": plain.running_var.numpy()}


def run_tensorflow() -> tuple[int, int, dict[str, np.ndarray]]:
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvdtrain.tensorflow  # noqa: F401
    from hvdtrain.tensorflow.syncbn import convert
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x = np.transpose(batch(), (0, 2, 3, 1))  # channels last, Keras's default axis
    plain = keras.layers.BatchNormalization(momentum=0.5)
    inputs = keras.Input(x.shape[1:])
    model = keras.Model(inputs, keras.layers.BatchNormalization(momentum=0.5)(inputs))
    convert(model)
    full = plain(x, training=True).numpy()
    with tf.GradientTape() as tape:
        part = model(x[rank::size], training=True)
        loss = tf.reduce_sum(part)
    tape.gradient(loss, model.trainable_variables)
    bn = model.layers[-1]
    return rank, size, {"out": part.numpy(), "expected_out": full[rank::size],
                        "mean": bn.moving_mean.numpy(), "expected_mean": plain.moving_mean.numpy(),
                        "var": bn.moving_variance.numpy(), "expected_var": plain.moving_variance.numpy()}


def main() -> None:
    out, framework = Path(sys.argv[1]), sys.argv[2]
    rank, size, arrays = run_torch() if framework == "torch" else run_tensorflow()
    np.savez(out / f"rank{rank}.npz", size=np.array(size), **arrays)


if __name__ == "__main__":
    main()
