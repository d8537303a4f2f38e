"""The own-loop side of the overhead benchmark: ``handwritten_torch.py``'s loop on the library API
(:class:`hvdtrain.torch.Trainer`, docs/own-loop.md).

The same model, data, optimizer, batch, epochs, evaluation and clock as the hand-written loop, with
the few lines the docs page changes: ``Trainer`` instead of ``hvd.init`` and the seeding,
``setup`` instead of the broadcasts and ``DistributedOptimizer``, ``dataloader`` instead of
``DistributedSampler``, ``trainer.backward`` instead of ``loss.backward``, ``trainer.save``
(atomic, with its manifest) instead of ``torch.save`` on rank 0. Both loops iterate a
``DataLoader`` over the same dataset (``handwritten_torch.Indexed``: a batch by one tensor
indexing, identity collation), the hand-written one with torch's ``DistributedSampler``, this one
with hvdtrain's global-batch sampler. The config pins what the hand-written loop hard-codes
(``hvdtrain_worker.overrides``).

The interleaved job calls :func:`run_torch` as variant ``api_worker:api_torch``, and
:func:`run_tf`, ``handwritten_tf.py``'s loop on :class:`hvdtrain.tensorflow.tape.TapeTrainer`, as
``api_worker:api_tf``: the hand-written loop's ``@tf.function`` step becomes ``@trainer.function``
(docs/own-loop.md's recommended form), which traces forward, allreduce and update into one
function as the hand-written step does; ``api_worker:api_tf_eager`` runs the same loop eagerly.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's hvdtrain, even where none is installed

import handwritten_torch  # noqa: E402
import hvdtrain_worker  # noqa: E402
import workload  # noqa: E402
from hvdtrain.torch import Trainer  # noqa: E402
from workload import BASE_LR, MOMENTUM  # noqa: E402


def run_torch(epochs: int, out_dir: Path) -> dict[str, Any]:
    """Trains from scratch on the API, evaluates, checkpoints; returns a measurement."""
    config = hvdtrain_worker.CONFIGS["torch"]
    trainer = Trainer(config, hvdtrain_worker.overrides("torch", epochs, out_dir))
    torch.set_num_threads(workload.threads_per_rank(trainer.engine.local_size))
    train_x, train_y, test_x, test_y = handwritten_torch.load_data()
    model = handwritten_torch.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR * trainer.size, momentum=MOMENTUM)
    model, optimizer = trainer.setup(model, optimizer)
    loader = trainer.dataloader(handwritten_torch.Indexed(train_x, train_y), num_workers=0,
                                collate_fn=handwritten_torch.keep_batch)

    clock = workload.Clock()
    started = time.perf_counter()
    steps = 0
    model.train()
    for epoch in trainer.epochs():
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            clock.step()
            optimizer.zero_grad()
            trainer.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            steps += 1
    clock.evaluation()
    _, eval_accuracy = handwritten_torch.evaluate(model, test_x, test_y)
    trainer.save()
    trainer.close()
    wall = time.perf_counter() - started
    return workload.measurement(trainer.rank, steps, len(train_y) * epochs, wall, eval_accuracy,
                                clock, epochs)


def run_tf(epochs: int, out_dir: Path, traced: bool = True) -> dict[str, Any]:
    """``handwritten_tf.py``'s loop on :class:`TapeTrainer`, its step decorated with
    ``@trainer.function`` (``traced``) or run eagerly; returns a measurement."""
    import keras
    import tensorflow as tf

    import handwritten_tf
    from hvdtrain.tensorflow.tape import TapeTrainer

    config = hvdtrain_worker.CONFIGS["tensorflow"]
    trainer = TapeTrainer(config, hvdtrain_worker.overrides("tensorflow", epochs, out_dir))
    train_x, train_y, test_x, test_y = workload.load_digits_split()
    model = handwritten_tf.make_model()
    optimizer = keras.optimizers.SGD(learning_rate=BASE_LR * trainer.size, momentum=MOMENTUM)
    model, _ = trainer.setup(model, optimizer)
    batches = trainer.dataset(train_x, train_y)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        trainer.apply_gradients(tape, loss)
        return loss

    # As the hand-written step: one trace, a free batch dimension for the short last batch.
    signature = [tf.TensorSpec([None, handwritten_tf.NUM_FEATURES], tf.float32),
                 tf.TensorSpec([None], tf.int64)]
    step = trainer.function(train_step, input_signature=signature) if traced else train_step
    clock = workload.Clock()
    started = time.perf_counter()
    steps = 0
    for epoch in trainer.epochs():
        batches.set_epoch(epoch)
        for x, y in batches:
            clock.step()
            step(x, y)
            steps += 1
    clock.evaluation()
    _, eval_accuracy = handwritten_tf.evaluate(model, test_x, test_y)
    trainer.save()
    trainer.close()
    wall = time.perf_counter() - started
    return workload.measurement(trainer.rank, steps, len(train_y) * epochs, wall, eval_accuracy,
                                clock, epochs)


def run_tf_eager(epochs: int, out_dir: Path) -> dict[str, Any]:
    """:func:`run_tf` with the step run eagerly (the API's form without ``@trainer.function``)."""
    return run_tf(epochs, out_dir, traced=False)


VARIANTS = {"api_torch": run_torch, "api_tf": run_tf, "api_tf_eager": run_tf_eager}
"""This worker's run functions by ``harness.Variant`` key."""
