"""The TensorFlow engine: a ``tf.function`` train step on ``hvd.DistributedGradientTape``.

Keras 3 notes (see shared/DESIGN.md): a Keras variable is not a ``tf.Variable``, so Horovod gets
``v.value``; Horovod's Keras API does not work with Keras 3, so this is a ``tf.GradientTape`` loop on
the low-level ``horovod.tensorflow`` ops; Horovod's XLA ops are not built, so no ``jit_compile``.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from pathlib import Path
from typing import IO, Any, Callable, Iterable

import hvdtrain.tensorflow  # noqa: F401  (quiets TensorFlow before it loads)
import horovod
import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from hvdtrain.adapters import ModelAdapter, make_adapter
from hvdtrain.config import Config
from hvdtrain.data import Dataset, Split, StepIndices
from hvdtrain.engine import Engine, add_batch_sums
from hvdtrain.errors import HvdtrainError
from hvdtrain.registry import MODELS
from hvdtrain.tensorflow.compression import horovod_compression
from hvdtrain.tensorflow.models import ClassifierAdapter


def make_optimizer(cfg: Config) -> keras.optimizers.Optimizer:
    """The configured Keras optimizer, with PyTorch's defaults where Keras differs (Adam's epsilon)."""
    o = cfg.optim
    if o.name == "sgd":
        return keras.optimizers.SGD(learning_rate=o.lr, momentum=o.momentum)
    if o.name == "adam":
        return keras.optimizers.Adam(learning_rate=o.lr, epsilon=1e-8)
    return keras.optimizers.AdamW(learning_rate=o.lr, weight_decay=o.weight_decay, epsilon=1e-8)


def _set_threads(count: int) -> None:
    try:
        tf.config.threading.set_intra_op_parallelism_threads(count)
        tf.config.threading.set_inter_op_parallelism_threads(count)
    except RuntimeError:
        # TensorFlow fixes its pools when its runtime starts: a second run in one process keeps them.
        current = tf.config.threading.get_intra_op_parallelism_threads()
        if current != count:
            warnings.warn(f"TensorFlow already runs with {current} threads per op; "
                          f"train.threads={count} applies to a new process only", stacklevel=2)


class TensorFlowEngine(Engine):
    """Trains a ``keras.Model`` on Horovod; see :class:`hvdtrain.engine.Engine`."""

    framework = "tensorflow"

    def __init__(self) -> None:
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()

    def prepare(self, cfg: Config, dataset: Dataset) -> None:
        # Ranks sharing a host would otherwise each start one thread per core and fight over them.
        _set_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // self.local_size))
        keras.utils.set_random_seed(cfg.seed + self.rank)
        self.adapter: ModelAdapter = make_adapter(MODELS["tensorflow"].get(cfg.model.name),
                                                  cfg.model.options, cfg.model.name, ClassifierAdapter)
        self.model = self.adapter.build(dataset.spec())
        if not isinstance(self.model, keras.Model):
            raise HvdtrainError(f"model {cfg.model.name!r}: build() must return a keras.Model")
        self.train_x, self.train_y = self._tensors(dataset.train())
        self.test_x, self.test_y = self._tensors(dataset.test())
        self.optimizer = make_optimizer(cfg)
        # Keras creates slot variables on the first apply; building them now lets rank 0's optimizer
        # state (and, on resume, a restored one) be broadcast before the first step.
        self.optimizer.build(self.model.trainable_variables)
        self.compression = horovod_compression(cfg.comm.compression)
        # L2 on the gradient, as torch's SGD and Adam do (Keras would decay the weights directly).
        self.l2 = cfg.optim.weight_decay if cfg.optim.name != "adamw" else 0.0
        self.accumulation = cfg.train.backward_passes_per_step
        # Gradient buffers only where there is something to accumulate: they cost a model's memory.
        self.accumulators = [tf.Variable(tf.zeros_like(v.value), trainable=False)
                             for v in self.model.trainable_variables] if self.accumulation > 1 else []
        self.lr = float("nan")  # the loop sets the real one before the first step
        self._compile(dataset.spec().input_shape)

    def broadcast_state(self) -> None:
        hvd.broadcast_variables(self._state_variables(), root_rank=0)

    @staticmethod
    def _tensors(split: Split) -> tuple[tf.Tensor, tf.Tensor]:
        return tf.constant(split.x), tf.constant(split.y)

    def _state_variables(self) -> list[tf.Variable]:
        return [v.value for v in [*self.model.variables, *self.optimizer.variables]]

    def _compile(self, input_shape: tuple[int, ...]) -> None:
        # One trace per function: a None batch dimension covers short and empty micro-batches.
        spec = (tf.TensorSpec([None], tf.int64), tf.TensorSpec([], tf.float32))
        self._accumulate_fn = tf.function(self._accumulate, input_signature=spec, jit_compile=False)
        self._apply_fn = tf.function(self._apply, input_signature=spec, jit_compile=False)
        self._eval_fn = tf.function(self._eval_batch, input_signature=spec[:1], jit_compile=False)

    def _scored(self, idx: tf.Tensor, x: tf.Tensor, y: tf.Tensor,
                training: bool) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        return self.adapter.loss_and_metrics(self.model, tf.gather(x, idx), tf.gather(y, idx),
                                             training=training)

    def _accumulate(self, idx: tf.Tensor, scale: tf.Tensor) -> tuple[tf.Tensor, dict]:
        """A micro-batch before the last of a step: local gradients only, no communication."""
        variables = [v.value for v in self.model.trainable_variables]
        with tf.GradientTape() as tape:
            loss_sum, metrics = self._scored(idx, self.train_x, self.train_y, True)
            target = loss_sum * scale
        for acc, grad in zip(self.accumulators, tape.gradient(target, variables)):
            acc.assign_add(grad)
        return loss_sum, metrics

    def _apply(self, idx: tf.Tensor, scale: tf.Tensor) -> tuple[tf.Tensor, dict]:
        """The step's last micro-batch: one allreduce of all accumulated gradients, then the update.

        DistributedGradientTape has no ``backward_passes_per_step``; adding ``sum(acc * v)`` to the
        loss makes the tape's gradient ``grad + acc`` exactly, so one tape allreduces the sum of all
        micro-batches' gradients, as Horovod's PyTorch optimizer does.
        """
        variables = [v.value for v in self.model.trainable_variables]
        with tf.GradientTape() as local:
            loss_sum, metrics = self._scored(idx, self.train_x, self.train_y, True)
            target = loss_sum * scale
            if self.accumulation > 1:
                target += tf.add_n([tf.reduce_sum(tf.stop_gradient(a) * v)
                                    for a, v in zip(self.accumulators, variables)])
        tape = hvd.DistributedGradientTape(local, compression=self.compression)
        grads = tape.gradient(target, variables)
        if self.l2:
            grads = [g + self.l2 * v for g, v in zip(grads, variables)]
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        for acc in self.accumulators:
            acc.assign(tf.zeros_like(acc))
        return loss_sum, metrics

    def _eval_batch(self, idx: tf.Tensor) -> tuple[tf.Tensor, dict]:
        return self._scored(idx, self.test_x, self.test_y, False)

    def train_step(self, step: StepIndices, lr: float) -> dict[str, float]:
        if lr != self.lr:
            self.optimizer.learning_rate.assign(lr)
            self.lr = lr
        # Horovod averages over ranks; weighting each rank's summed loss by size / global_count makes
        # the result the mean over the step's samples, even when ranks hold unequal shares.
        scale = tf.constant(self.size / step.global_count, tf.float32)
        sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
        for i, idx in enumerate(step.micro):
            fn = self._apply_fn if i == len(step.micro) - 1 else self._accumulate_fn
            loss_sum, metrics = fn(tf.constant(idx, tf.int64), scale)
            add_batch_sums(sums, loss_sum, metrics, len(idx))
        return sums

    def evaluate(self, batches: Iterable[np.ndarray]) -> dict[str, float]:
        sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
        for idx in batches:
            loss_sum, metrics = self._eval_fn(tf.constant(idx, tf.int64))
            add_batch_sums(sums, loss_sum, metrics, len(idx))
        return sums

    def start_allreduce_sums(self, sums: dict[str, float]) -> Callable[[], dict[str, float]]:
        # Eager Horovod ops in TensorFlow complete before they return: nothing is left to wait for.
        keys = sorted(sums)
        values = tf.constant([sums[k] for k in keys], tf.float64)
        total = dict(zip(keys, hvd.allreduce(values, op=hvd.Sum, name="hvdtrain.sums").numpy().tolist()))
        return lambda: total

    def write_checkpoint(self, fileobj: IO[bytes], meta: dict[str, Any]) -> None:
        arrays = {f"model/{i}": v.numpy() for i, v in enumerate(self.model.variables)}
        arrays |= {f"optimizer/{i}": v.numpy() for i, v in enumerate(self.optimizer.variables)}
        buffer = io.BytesIO()  # np.savez seeks, which the atomic writer's file allows, but be safe
        np.savez(buffer, meta=np.array(json.dumps(meta)), **arrays)
        fileobj.write(buffer.getvalue())

    def read_checkpoint(self, path: Path) -> dict[str, Any]:
        # allow_pickle=False: loading a checkpoint must never execute code from the file.
        with np.load(path, allow_pickle=False) as data:
            for prefix, variables in (("model", self.model.variables),
                                      ("optimizer", self.optimizer.variables)):
                for i, var in enumerate(variables):
                    self._restore(var, data[f"{prefix}/{i}"], f"{prefix}/{i}", path)
            return json.loads(str(data["meta"]))

    @staticmethod
    def _restore(var: Any, value: np.ndarray, name: str, path: Path) -> None:
        if tuple(var.shape) != value.shape:
            raise HvdtrainError(f"checkpoint {path}: {name} has shape {value.shape}, "
                                f"the model has {tuple(var.shape)}")
        var.assign(value)

    def parameters(self) -> dict[str, np.ndarray]:
        # Positions, not Keras paths: paths carry per-process counters (dense_1, dense_2, ...).
        return {f"{i}.{v.name}": v.numpy().copy() for i, v in enumerate(self.model.trainable_variables)}

    def versions(self) -> dict[str, str]:
        return {"tensorflow": tf.__version__, "keras": keras.__version__,
                "horovod": horovod.__version__}
