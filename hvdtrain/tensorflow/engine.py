"""The TensorFlow engine. For the dense methods (``none``, ``fp16``) a step is one ``tf.function``:
local gradients, Horovod's grouped allreduce and the update, as a hand-written
``DistributedGradientTape`` loop runs it; two timestamps inside it give the time waited for the
allreduce. The other methods run local gradients in a ``tf.function``, the gradient exchange of
:mod:`hvdtrain.tensorflow.compression` (timed: eager Horovod calls return when the collectives are
done), then the update in a ``tf.function``.

Keras 3 notes: a Keras variable is not a ``tf.Variable``, so Horovod gets
``v.value``; Horovod's Keras API does not work with Keras 3, so this is a ``tf.GradientTape`` loop on
the low-level ``horovod.tensorflow`` ops; Horovod's XLA ops are not built, so no ``jit_compile``.
"""

from __future__ import annotations

import io
import json
import math
import time
import warnings
from typing import Any, Callable, Iterable

import hvdtrain.tensorflow  # noqa: F401  (quiets TensorFlow before it loads)
import horovod
import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from hvdtrain.adapters import ModelAdapter, make_adapter
from hvdtrain.checkpoint import not_a_checkpoint
from hvdtrain.config import Config
from hvdtrain.data.contracts import Dataset
from hvdtrain.data.loading import loader_workers
from hvdtrain.data.sampler import StepIndices
from hvdtrain.data.tree import leading_size
from hvdtrain.engine import Engine, add_batch_sums, compute_threads, start_horovod
from hvdtrain.errors import HvdtrainError
from hvdtrain.registry import MODELS
from hvdtrain.tensorflow import rng, syncbn
from hvdtrain.tensorflow.collectives import TensorFlowCollectives
from hvdtrain.tensorflow.compression import dense_mean, make_exchange
from hvdtrain.tensorflow.device import place, resolve, summary
from hvdtrain.tensorflow.data import TensorFlowLoader, batch_signature
from hvdtrain.tensorflow.models import ClassifierAdapter
from hvdtrain.tensorflow.precision import Precision


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


def _concrete(function: Any) -> Callable[..., Any]:
    """Calls ``function``'s one concrete function (``function`` has an input signature), traced on
    the first call. Called directly, it skips what a ``tf.function`` call does every time to match
    its arguments to a trace, which costs as much as running a small model's step."""
    concrete = None

    def call(*args: Any) -> Any:
        nonlocal concrete
        if concrete is None:
            concrete = function.get_concrete_function()
        return concrete(*args)
    return call


class TensorFlowEngine(Engine):
    """Trains a ``keras.Model`` on Horovod; see :class:`hvdtrain.engine.Engine`."""

    framework = "tensorflow"

    def __init__(self, cfg: Config, dataset: Dataset) -> None:
        self.collectives = TensorFlowCollectives()
        self.adapter: ModelAdapter = make_adapter(MODELS["tensorflow"].get(cfg.model.name),
                                                  cfg.model.options, cfg.model.name, ClassifierAdapter)
        kind = resolve(cfg.train.device)  # before Horovod starts: a wrong train.device stops here
        self.cycle_time_ms = start_horovod(hvd, cfg.comm.cycle_time_ms)
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        _set_threads(compute_threads(cfg.train.threads, self.local_size))
        self.device_kind, self.gpu = kind, place(kind, self.local_rank, self.local_size)
        self.precision = Precision(cfg.train.precision)
        keras.utils.set_random_seed(cfg.seed + self.rank)
        with self.precision.policy():
            self.model = self._build(cfg, dataset)
        if cfg.model.sync_batchnorm:
            syncbn.convert(self.model)
        self.spec = dataset.spec()
        self.data = TensorFlowLoader(dataset.train(), dataset.test(), seed=cfg.seed, rank=self.rank,
                                     workers=loader_workers(cfg.data.workers, self.local_size),
                                     prefetch=cfg.data.prefetch, spec=self.spec)
        self.optimizer = self.precision.wrap(make_optimizer(cfg))
        # Keras creates slot variables on the first apply; building them now lets rank 0's optimizer
        # state (and, on resume, a restored one) be broadcast before the first step.
        self.optimizer.build(self.model.trainable_variables)
        self.exchange = make_exchange(cfg.comm, cfg.seed, self.rank, self.size,
                                      [v.shape for v in self.model.trainable_variables])
        # Methods that send every tensor dense need no stage between the collectives: one traced
        # step saves the calls, and the host round trips, of the split one.
        self.fused = self.exchange.plan.dense
        self._scale_cache: tuple[float, tf.Tensor | None] = (math.nan, None)
        self.stats: dict[str, float] = {}
        # L2 on the gradient, as torch's SGD and Adam do (Keras would decay the weights directly).
        self.l2 = cfg.optim.weight_decay if cfg.optim.name != "adamw" else 0.0
        self.accumulation = cfg.train.backward_passes_per_step
        # Gradient buffers only where there is something to accumulate: they cost a model's memory.
        self.accumulators = [tf.Variable(tf.zeros_like(v.value), trainable=False)
                             for v in self.model.trainable_variables] if self.accumulation > 1 else []
        self.lr = float("nan")  # the loop sets the real one before the first step
        self._compile()

    def _build(self, cfg: Config, dataset: Dataset) -> keras.Model:
        model = self.adapter.build(dataset.spec())
        if not isinstance(model, keras.Model):
            raise HvdtrainError(f"model {cfg.model.name!r}: build() must return a keras.Model")
        return model

    def broadcast_state(self) -> None:
        hvd.broadcast_variables(self._state_variables(), root_rank=0)
        self._follow_world()
        self.exchange.broadcast(root_rank=0)

    def _follow_world(self) -> None:
        """Elastic mode may have changed this rank's place and the world size since the exchange
        was built; its traced functions hold them."""
        if (self.exchange.rank, self.exchange.size) != (self.rank, self.size):
            self.exchange.resize(self.rank, self.size)
        if self.fused and self._traced_size != self.size:
            self._compile()  # the fused step decides when traced whether there is anyone to send to

    def _state_variables(self) -> list[tf.Variable]:
        return [v.value for v in [*self.model.variables, *self.optimizer.variables]]

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        self._follow_world()
        if self.accumulation == accumulation:
            return
        self.accumulation = accumulation
        if accumulation > 1 and not self.accumulators:
            self.accumulators = [tf.Variable(tf.zeros_like(v.value), trainable=False)
                                 for v in self.model.trainable_variables]
        # Whether the step functions accumulate at all is decided when they are traced.
        self._compile()

    def fork_rng(self, seed: int, step: int) -> None:
        rng.fork(seed, self.rank, step)

    def _compile(self) -> None:
        # One trace per function: a None batch dimension covers short and empty micro-batches.
        batch = (*batch_signature(self.spec), tf.TensorSpec([], tf.float32))
        grads = [tf.TensorSpec(v.shape, tf.float32) for v in self.model.trainable_variables]
        self._traced_size = self.size
        self._accumulate_fn = _concrete(tf.function(self._accumulate, input_signature=batch,
                                                    jit_compile=False))
        self._fused_fn = _concrete(tf.function(self._fused_step, input_signature=batch,
                                               jit_compile=False))
        self._gradients_fn = _concrete(tf.function(self._gradients, input_signature=batch,
                                                   jit_compile=False))
        self._apply_fn = _concrete(tf.function(self._apply, input_signature=[grads],
                                               jit_compile=False))
        self._eval_fn = tf.function(self._eval_batch, input_signature=batch[:2], jit_compile=False)

    def _local_gradients(self, x: tf.Tensor, y: tf.Tensor, scale: tf.Tensor
                         ) -> tuple[tf.Tensor, dict, list[tf.Tensor]]:
        variables = [v.value for v in self.model.trainable_variables]
        with tf.GradientTape() as tape:
            loss_sum, metrics = self.adapter.loss_and_metrics(self.model, x, y, training=True)
            target = self.precision.scale(self.optimizer, loss_sum * scale)
        # Zeros, not None, for a variable the loss does not reach: every rank sends every tensor.
        grads = tape.gradient(target, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return loss_sum, metrics, grads

    def _accumulate(self, x: tf.Tensor, y: tf.Tensor, scale: tf.Tensor) -> tuple[tf.Tensor, dict]:
        """A micro-batch before the last of a step: local gradients only, no communication."""
        loss_sum, metrics, grads = self._local_gradients(x, y, scale)
        for acc, grad in zip(self.accumulators, grads):
            acc.assign_add(grad)
        return loss_sum, metrics

    def _gradients(self, x: tf.Tensor, y: tf.Tensor, scale: tf.Tensor
                   ) -> tuple[tf.Tensor, dict, list[tf.Tensor]]:
        """The step's last micro-batch: its gradients plus the accumulated ones, ready to exchange
        (one exchange per step, as Horovod's ``backward_passes_per_step`` does)."""
        loss_sum, metrics, grads = self._local_gradients(x, y, scale)
        if self.accumulators:
            grads = [g + acc for g, acc in zip(grads, self.accumulators)]
            for acc in self.accumulators:
                acc.assign(tf.zeros_like(acc))
        return loss_sum, metrics, grads

    def _fused_step(self, x: tf.Tensor, y: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
        """The step's last micro-batch, the allreduce of a dense method and the update in one
        function. Returns its loss sum, its metrics (in ``_metric_keys`` order) and the seconds
        from the gradients being ready to their average as one float64 vector: one copy to the
        host a step."""
        loss_sum, metrics, grads = self._gradients(x, y, scale)
        self._metric_keys = sorted(metrics)  # set while tracing, before the first result is read
        with tf.control_dependencies(grads):
            ready = tf.timestamp()
        with tf.control_dependencies([ready]):  # the allreduce starts after the clock reads
            grads = [tf.identity(g) for g in grads]
        averaged = dense_mean(grads, self.exchange.plan.dense_dtype, self.size)
        with tf.control_dependencies(averaged):
            comm_s = tf.timestamp() - ready
        self._apply(averaged)
        values = [loss_sum, *(metrics[k] for k in self._metric_keys), comm_s]
        return tf.stack([tf.cast(v, tf.float64) for v in values])

    def _apply(self, grads: list[tf.Tensor]) -> None:
        """The update with the exchanged (averaged) gradients."""
        self.precision.note(grads)
        if self.l2:  # scaled as the gradients are: the loss-scale optimizer unscales both
            grads = [g + self.precision.scale(self.optimizer, self.l2 * v.value)
                     for g, v in zip(grads, self.model.trainable_variables)]
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))

    def _eval_batch(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, dict]:
        return self.adapter.loss_and_metrics(self.model, x, y, training=False)

    def train_step(self, step: StepIndices, lr: float) -> dict[str, float]:
        if lr != self.lr:
            self.optimizer.learning_rate.assign(lr)
            self.lr = lr
        self._follow_world()
        started = time.perf_counter()
        # Horovod averages over ranks; weighting each rank's summed loss by size / global_count makes
        # the result the mean over the step's samples, even when ranks hold unequal shares.
        scale = self._scale(self.size / step.global_count)
        sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
        data_s = 0.0  # the wait for each micro-batch: what prefetching did not hide
        batches = self.data.batches(step)
        for i, idx in enumerate(step.micro):
            tick = time.perf_counter()
            x, y = next(batches)
            data_s += time.perf_counter() - tick
            if i < len(step.micro) - 1:
                loss_sum, metrics = self._accumulate_fn(x, y, scale)
            elif self.fused:
                loss_sum, *values, comm = self._fused_fn(x, y, scale).numpy().tolist()
                metrics = dict(zip(self._metric_keys, values))
            else:
                loss_sum, metrics, grads = self._gradients_fn(x, y, scale)
            add_batch_sums(sums, loss_sum, metrics, len(idx))
        exchange = self._fused_stats(comm) if self.fused else self._exchange(grads)
        self.stats = {"data_s": data_s, "comm_s": exchange["comm_s"],
                      "compute_s": time.perf_counter() - started - data_s - exchange["comm_s"],
                      "compress_s": exchange.get("compress_s", 0.0),
                      "wire_bytes": exchange["wire_bytes"], "dense_bytes": exchange["dense_bytes"]}
        return sums

    def _exchange(self, grads: list[tf.Tensor]) -> dict[str, float]:
        """The split step's exchange and update; the exchange's measurements."""
        self._apply_fn(self.exchange.run(grads))
        return self.exchange.stats

    def _fused_stats(self, comm: float) -> dict[str, float]:
        """What the split step's exchange would report for a fused step."""
        self.exchange.step += 1  # checkpoints carry the exchange's step count, whichever path ran
        plan, sent = self.exchange.plan, self.size > 1
        return {"comm_s": comm, "wire_bytes": float(plan.wire_bytes()) if sent else 0.0,
                "dense_bytes": float(plan.dense_bytes()) if sent else 0.0}

    def _scale(self, value: float) -> tf.Tensor:
        """``value`` as a tensor, made again only when it changes (the last step of an epoch)."""
        if self._scale_cache[0] != value:
            self._scale_cache = (value, tf.constant(value, tf.float32))
        return self._scale_cache[1]

    def step_stats(self) -> dict[str, float]:
        return {**self.stats, "skipped": self.precision.skipped}

    def evaluate(self, batches: Iterable[np.ndarray]) -> dict[str, float]:
        sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
        for x, y in self.data.eval_batches(batches):
            loss_sum, metrics = self._eval_fn(x, y)
            add_batch_sums(sums, loss_sum, metrics, leading_size(x))
        return sums

    def state_bytes(self, meta: dict[str, Any]) -> bytes:
        arrays = {f"model/{i}": v.numpy() for i, v in enumerate(self.model.variables)}
        arrays |= {f"optimizer/{i}": v.numpy() for i, v in enumerate(self.optimizer.variables)}
        arrays |= {f"rng/{name}": value for name, value in rng.capture().items()}
        arrays |= {f"compression/{k}": v for k, v in self.exchange.state_dict().items()}
        buffer = io.BytesIO()
        np.savez(buffer, meta=np.array(json.dumps(meta)), **arrays)
        return buffer.getvalue()

    def gather_state(self) -> None:
        self.exchange.gather()

    def load_state(self, data: bytes, where: str) -> dict[str, Any]:
        # allow_pickle=False: loading a checkpoint must never execute code from the file.
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files}
            meta = json.loads(str(arrays["meta"]))
            expected = [f"{prefix}/{i}" for prefix, variables in (
                ("model", self.model.variables), ("optimizer", self.optimizer.variables))
                for i in range(len(variables))]
            missing = [name for name in expected if name not in arrays]
            if missing or not isinstance(meta, dict):
                raise KeyError(f"no entry {missing[0]}" if missing else "meta is not a mapping")
        except Exception as exc:  # whatever the file holds, the user gets one line naming it
            raise not_a_checkpoint(where, exc) from None
        try:
            for prefix, variables in (("model", self.model.variables),
                                      ("optimizer", self.optimizer.variables)):
                for i, var in enumerate(variables):
                    self._restore(var, arrays[f"{prefix}/{i}"], f"{prefix}/{i}", where)
            states = {name[4:]: value for name, value in arrays.items() if name.startswith("rng/")}
            if states:  # absent in checkpoints written before random states were saved
                rng.restore(states)
            self.exchange.load_state_dict({name[12:]: value for name, value in arrays.items()
                                           if name.startswith("compression/")}, where)
        except HvdtrainError:
            raise
        except Exception as exc:  # entries of the wrong type, or not what hvdtrain wrote
            raise HvdtrainError(f"{where} does not fit the model: {type(exc).__name__}: "
                                f"{(str(exc).strip().splitlines() or [''])[0][:160]}") from None
        return meta

    @staticmethod
    def _restore(var: Any, value: np.ndarray, name: str, where: str) -> None:
        if tuple(var.shape) != value.shape:
            raise HvdtrainError(f"{where}: {name} has shape {value.shape}, "
                                f"the model has {tuple(var.shape)}")
        var.assign(value)

    def parameters(self) -> dict[str, np.ndarray]:
        # Positions, not Keras paths: paths carry per-process counters (dense_1, dense_2, ...).
        return {f"{i}.{v.name}": v.numpy().copy() for i, v in enumerate(self.model.trainable_variables)}

    def versions(self) -> dict[str, str]:
        return {"tensorflow": tf.__version__, "keras": keras.__version__,
                "horovod": horovod.__version__}

    def placement(self) -> dict[str, str]:
        return summary(self.device_kind, self.gpu)
