"""The baseline of the TensorFlow overhead benchmark: a Horovod TensorFlow loop written by hand.

It is what a user writes after Horovod's ``examples/tensorflow2/tensorflow2_mnist.py``, adapted to
Keras 3 (a Keras variable is not a ``tf.Variable``, so Horovod gets ``v.value``) and trained on the
same problem as ``configs/digits_tf.yaml``: scikit-learn's digits (the split of
``hvdtrain.data.digits.DigitsDataset``), a Dense(128, relu) -> Dense(10) MLP, Keras SGD at ``0.05 x
size`` with momentum 0.9, a ``tf.function`` step on ``hvd.DistributedGradientTape``, a per-rank
batch of 32 from a permutation that all ranks draw alike each epoch and shard by rank, then one
evaluation on the test split and one ``np.savez`` of the variables on rank 0. The data stay in
memory and batches are cut by indexing, as ``handwritten_torch.py`` and hvdtrain do, so that
``tf.data``'s per-batch iterator cost does not enter the comparison. It deliberately does not import
hvdtrain.

The interleaved job (``workload.job_main``) calls :func:`run` as variant
``handwritten_tf:handwritten_tf``. The wall time runs from the first step (its
``tf.function`` trace included) through the final evaluation and save (process start, imports,
``hvd.init``, data loading and the initial broadcast are excluded, as in hvdtrain's
``summary["wall_time_s"]``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# TensorFlow's C++ start-up notices (CPU features, oneDNN) would bury the measurement line.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import workload
from workload import BASE_LR, BATCH_SIZE, EVAL_BATCH_SIZE, HIDDEN, MOMENTUM, SEED

NUM_FEATURES, NUM_CLASSES = 64, 10

TrainStep = Callable[[np.ndarray, np.ndarray], tf.Tensor]


def set_threads(count: int) -> None:
    """Limits TensorFlow's thread pools; it raises if its runtime has already started."""
    tf.config.threading.set_intra_op_parallelism_threads(count)
    tf.config.threading.set_inter_op_parallelism_threads(count)


def make_model() -> keras.Model:
    """An MLP with hvdtrain's ``mlp`` architecture for ``hidden: [128]`` (Keras's default init)."""
    return keras.Sequential([keras.Input(shape=(NUM_FEATURES,)),
                             keras.layers.Dense(HIDDEN, activation="relu"),
                             keras.layers.Dense(NUM_CLASSES)])


def make_train_step(model: keras.Model, optimizer: keras.optimizers.Optimizer) -> TrainStep:
    """The ``tf.function`` training step: forward, Horovod-averaged gradients, optimizer update."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    # A fixed signature with a free batch dimension: the short last batch of an epoch reuses the
    # one trace instead of paying for a second. No jit_compile: Horovod's XLA ops are not built.
    @tf.function(input_signature=[tf.TensorSpec([None, NUM_FEATURES], tf.float32),
                                  tf.TensorSpec([None], tf.int64)], jit_compile=False)
    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, [v.value for v in model.trainable_variables])
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return train_step


def epoch_batches(num_samples: int, epoch: int) -> Iterator[np.ndarray]:
    """This rank's batch indices for ``epoch``.

    Every rank draws the same permutation (seeded by the epoch, so the shards change from epoch to
    epoch) and keeps every ``size``-th sample of it, as ``DistributedSampler`` does.
    """
    order = np.random.default_rng([SEED, epoch]).permutation(num_samples)[hvd.rank()::hvd.size()]
    for begin in range(0, len(order), BATCH_SIZE):
        yield order[begin:begin + BATCH_SIZE]


def train(train_step: TrainStep, x: np.ndarray, y: np.ndarray, epochs: int,
          clock: workload.Clock) -> int:
    """Trains for ``epochs`` epochs and returns the number of optimizer steps."""
    steps = 0
    for epoch in range(epochs):
        for idx in epoch_batches(len(y), epoch):
            clock.step()
            train_step(x[idx], y[idx])
            steps += 1
    return steps


def evaluate(model: keras.Model, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean test loss and accuracy over all ranks; each rank scores every ``size``-th sample."""
    mine = np.arange(hvd.rank(), len(y), hvd.size())
    loss_sum = correct = 0.0
    for begin in range(0, len(mine), EVAL_BATCH_SIZE):
        idx = mine[begin:begin + EVAL_BATCH_SIZE]
        logits = model(x[idx], training=False)
        losses = keras.losses.sparse_categorical_crossentropy(y[idx], logits, from_logits=True)
        loss_sum += float(tf.reduce_sum(losses))
        correct += float(np.sum(np.argmax(logits, axis=1) == y[idx]))
    totals = hvd.allreduce(tf.constant([loss_sum, correct, float(len(mine))], tf.float64),
                           op=hvd.Sum, name="eval").numpy()
    return totals[0] / totals[2], totals[1] / totals[2]


def save(model: keras.Model, optimizer: keras.optimizers.Optimizer, path: Path) -> None:
    """Saves the model's and the optimizer's variables to one ``.npz`` file."""
    arrays = {f"model/{i}": v.numpy() for i, v in enumerate(model.variables)}
    arrays |= {f"optimizer/{i}": v.numpy() for i, v in enumerate(optimizer.variables)}
    np.savez(path, **arrays)


def init() -> None:
    """Starts Horovod and limits TensorFlow's threads, once per process (later calls do nothing)."""
    hvd.init()
    # TensorFlow fixes its pools when its runtime starts (RuntimeError after that): an earlier run
    # in this process (this worker's or hvdtrain's, with the same count) has set them already.
    with contextlib.suppress(RuntimeError):
        set_threads(workload.threads_per_rank(hvd.local_size()))


def run(epochs: int, out_dir: Path) -> dict[str, Any]:
    """Trains from scratch, evaluates, saves to ``out_dir`` on rank 0; returns a measurement.

    Every call builds its own model, optimizer and ``tf.function`` step and reseeds, so repeated
    calls in one process (``workload.job_main``) are independent and alike, each with its own
    trace.
    """
    init()
    keras.utils.set_random_seed(SEED + hvd.rank())
    train_x, train_y, test_x, test_y = workload.load_digits_split()
    model = make_model()
    optimizer = keras.optimizers.SGD(learning_rate=BASE_LR * hvd.size(), momentum=MOMENTUM)
    # Keras creates the momentum slots on the first update; building them now lets rank 0's whole
    # state be broadcast once, before training, instead of after the first step.
    optimizer.build(model.trainable_variables)
    hvd.broadcast_variables([v.value for v in [*model.variables, *optimizer.variables]],
                            root_rank=0)
    train_step = make_train_step(model, optimizer)

    clock = workload.Clock()
    started = time.perf_counter()
    steps = train(train_step, train_x, train_y, epochs, clock)
    clock.evaluation()
    _, eval_accuracy = evaluate(model, test_x, test_y)
    if hvd.rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        save(model, optimizer, out_dir / "checkpoint.npz")
    wall = time.perf_counter() - started
    return workload.measurement(hvd.rank(), steps, len(train_y) * epochs, wall, eval_accuracy,
                                clock, epochs)


VARIANTS = {"handwritten_tf": run}
"""This worker's run functions by ``harness.Variant`` key."""
