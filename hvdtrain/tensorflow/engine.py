"""The TensorFlow engine: a Keras model, its optimizer and loader on Horovod, driven by the
framework-free loop; a step is :func:`hvdtrain.step.train_step` over
:class:`hvdtrain.tensorflow.step.TensorFlowKernels` and the run's gradient exchange
(:mod:`hvdtrain.tensorflow.exchange`).

Keras 3 notes: Horovod's Keras API does not work with Keras 3, so this is a ``tf.GradientTape``
loop on the low-level ``horovod.tensorflow`` ops (:mod:`hvdtrain.tensorflow.step`).
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Iterable
from typing import Any

import horovod
import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from hvdtrain.adapters import ModelAdapter, make_adapter
from hvdtrain.checkpoint import not_a_checkpoint
from hvdtrain.compression.rules import OptimizerSettings
from hvdtrain.compression.state import by_index
from hvdtrain.config import Config, OptimConfig
from hvdtrain.data.contracts import Dataset
from hvdtrain.data.loading import loader_workers
from hvdtrain.data.sampler import StepIndices
from hvdtrain.data.tree import leading_size
from hvdtrain.engine import Engine
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import ExchangeRequest
from hvdtrain.horovod_start import compute_threads, start_horovod
from hvdtrain.layout import Layout
from hvdtrain.ps.mpi import horovod_comm, ps_settings
from hvdtrain.registry import MODELS
from hvdtrain.step import add_batch_sums, train_step
from hvdtrain.tensorflow import rng, syncbn
from hvdtrain.tensorflow.collectives import TensorFlowCollectives
from hvdtrain.tensorflow.data import TensorFlowLoader, batch_signature
from hvdtrain.tensorflow.device import place, resolve, summary
from hvdtrain.tensorflow.exchange import applies_update, make_exchange
from hvdtrain.tensorflow.models import ClassifierAdapter
from hvdtrain.tensorflow.parts import COMPRESSION, assign, named_state, read_parts, trainable_names
from hvdtrain.tensorflow.precision import Precision
from hvdtrain.tensorflow.recompute import recompute_units
from hvdtrain.tensorflow.step import TensorFlowKernels


def make_optimizer(o: OptimConfig) -> keras.optimizers.Optimizer:
    """The configured Keras optimizer, with PyTorch's defaults where Keras's differ (Adam's eps).
    Where an exchange applies the update rule, its factory hands the step plain SGD instead
    (:func:`hvdtrain.tensorflow.exchange.stepping_optimizer`)."""
    if o.name == "sgd":
        return keras.optimizers.SGD(learning_rate=o.lr, momentum=o.momentum)
    if o.name == "adam":
        return keras.optimizers.Adam(learning_rate=o.lr, epsilon=1e-8)
    return keras.optimizers.AdamW(learning_rate=o.lr, weight_decay=o.weight_decay, epsilon=1e-8)


def optimizer_settings(o: OptimConfig) -> OptimizerSettings:
    """What an exchange's update rule needs of :func:`make_optimizer`'s optimizer (Keras's betas,
    PyTorch's eps, as there; weight decay as L2 for SGD and Adam, decoupled for AdamW)."""
    return OptimizerSettings(o.name, momentum=o.momentum if o.name == "sgd" else 0.0,
                             weight_decay=o.weight_decay, beta1=0.9, beta2=0.999, eps=1e-8)


def l2_decay(o: OptimConfig, plain: bool) -> float:
    """The weight decay the step adds to the gradients as L2, as torch's SGD and Adam do (AdamW
    decays the weights itself; an exchange's update rule adds the decay in its directions)."""
    return 0.0 if plain or o.name == "adamw" else o.weight_decay


def set_threads(count: int) -> None:
    """TensorFlow's op pools at ``count`` threads (a warning where its runtime already runs)."""
    try:
        tf.config.threading.set_intra_op_parallelism_threads(count)
        tf.config.threading.set_inter_op_parallelism_threads(count)
    except RuntimeError:
        # TensorFlow fixes its pools when its runtime starts: a second run in a process keeps them.
        current = tf.config.threading.get_intra_op_parallelism_threads()
        if current != count:
            warnings.warn(f"TensorFlow already runs with {current} threads per op; "
                          f"train.threads={count} applies to a new process only", stacklevel=2)


class TensorFlowEngine(Engine):
    """Trains a ``keras.Model`` on Horovod; see :class:`hvdtrain.engine.Engine`."""

    framework = "tensorflow"

    def __init__(self, cfg: Config, dataset: Dataset) -> None:
        self._start(cfg)
        keras.utils.set_random_seed(cfg.seed + self.rank)
        with self.precision.policy():
            self.model = self._build(cfg, dataset)
        if cfg.model.sync_batchnorm:
            syncbn.convert(self.model)
        self.spec = dataset.spec()
        self.data = TensorFlowLoader(dataset.train(), dataset.test(), seed=cfg.seed, rank=self.rank,
                                     workers=loader_workers(cfg.data.workers, self.local_size),
                                     prefetch=cfg.data.prefetch, spec=self.spec)
        self.stats: dict[str, float] = {}
        self.accumulation = cfg.train.backward_passes_per_step
        self._make_update(cfg, self.model.trainable_variables)
        self._eval_fn = tf.function(self._eval_batch, input_signature=batch_signature(self.spec),
                                    jit_compile=False)

    def _make_update(self, cfg: Config, variables: list[Any]) -> None:
        """The exchange, the optimizer over ``variables`` (the trainable ones) and the kernels
        that step them (:class:`hvdtrain.tensorflow.shard.ShardedEngine` makes its own)."""
        self.exchange, optimizer = make_exchange(cfg, ExchangeRequest(
            cfg.comm, cfg.seed, self.rank, self.size, variables,
            optimizer=make_optimizer(cfg.optim), settings=optimizer_settings(cfg.optim),
            accumulation=self.accumulation, ps=ps_settings(cfg), shard=cfg.shard,
            layout=self.layout))
        plain = applies_update(self.exchange)  # the exchange applies the optimizer's rule
        self.optimizer = self.precision.wrap(optimizer)
        # Keras creates slot variables on the first apply; building them now lets rank 0's optimizer
        # state (and, on resume, a restored one) be broadcast before the first step.
        self.optimizer.build(variables)
        self.kernels = TensorFlowKernels(
            self.model, self.optimizer, self.adapter, self.data, self.precision, self.spec,
            l2=l2_decay(cfg.optim, plain))
        self.kernels.clip_norm = cfg.optim.clip_norm
        self.kernels.follow(self.exchange, self.accumulation)

    def _start(self, cfg: Config) -> None:
        """The adapter, Horovod, threads, device and precision: what every TensorFlow engine
        sets up before its model (the pipeline's too)."""
        self.collectives = TensorFlowCollectives()
        self.adapter: ModelAdapter = make_adapter(
            MODELS["tensorflow"].get(cfg.model.name), cfg.model.options, cfg.model.name,
            ClassifierAdapter)
        kind = resolve(cfg.train.device)  # before Horovod starts: a wrong train.device stops here
        self.cycle_time_ms = start_horovod(hvd, cfg.comm.cycle_time_ms,
                                           process_sets=cfg.pipeline.stages > 1,
                                           comm=horovod_comm(cfg))
        self.rank, self.size = hvd.rank(), hvd.size()
        self.layout = Layout.of(cfg, self.size)  # the job's ranks: who holds which part
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        set_threads(compute_threads(cfg.train.threads, self.local_size))
        self.device_kind, self.gpu = kind, place(kind, self.local_rank, self.local_size)
        self.precision = Precision(cfg.train.precision, cfg.train.loss_scale)

    def _build(self, cfg: Config, dataset: Dataset) -> keras.Model:
        model = self.adapter.build(dataset.spec())
        if not isinstance(model, keras.Model):
            raise HvdtrainError(f"model {cfg.model.name!r}: build() must return a keras.Model")
        if cfg.model.activation_checkpointing:  # per unit: the model's layers
            recompute_units(model)
        return model

    def broadcast_state(self) -> None:
        hvd.broadcast_variables(self._state_variables(), root_rank=0)
        self._follow_world()
        self.exchange.broadcast(root_rank=0)

    def _follow_world(self) -> None:
        """Elastic mode may have changed this rank's place and the world size since the exchange
        was built; it and the traced kernels hold them."""
        if (self.exchange.rank, self.exchange.size) != (self.rank, self.size):
            self.exchange.resize(self.rank, self.size, self.accumulation)
        self.kernels.follow(self.exchange, self.accumulation)

    def _state_variables(self) -> list[tf.Variable]:
        return [v.value for v in [*self.model.variables, *self.optimizer.variables]]

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        self.rank, self.size = rank, size
        self.layout = self.layout.resized(size)
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        self.accumulation = accumulation
        self._follow_world()

    def finish(self) -> None:
        self.exchange.finish()

    def fork_rng(self, seed: int, step: int) -> None:
        rng.fork(seed, self.rank, step)

    def _eval_batch(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, dict]:
        return self.adapter.loss_and_metrics(self.model, x, y, training=False)

    def train_step(self, step: StepIndices, lr: float) -> dict[str, float]:
        self._follow_world()
        result = train_step(self.kernels, self.exchange, step, lr, self.size)
        self.stats = result.stats
        return result.sums

    def step_stats(self) -> dict[str, float]:
        return dict(self.stats)

    def evaluate(self, batches: Iterable[np.ndarray]) -> dict[str, float]:
        sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
        for x, y in self.data.eval_batches(batches):
            loss_sum, metrics = self._eval_fn(x, y)
            add_batch_sums(sums, loss_sum, metrics, leading_size(x))
        return sums

    def state_bytes(self, meta: dict[str, Any]) -> bytes:
        arrays: dict[str, Any] = {f"model/{i}": v for i, v in enumerate(self._model_arrays())}
        arrays |= {f"optimizer/{i}": v for i, v in enumerate(self._optimizer_arrays())}
        arrays |= {f"rng/{name}": value for name, value in rng.capture().items()}
        arrays |= {COMPRESSION + k: v for k, v in (self.exchange.state_dict() or {}).items()}
        arrays |= self._global_names()
        buffer = io.BytesIO()
        np.savez(buffer, meta=np.array(json.dumps(meta)), **arrays)
        return buffer.getvalue()

    def _model_arrays(self) -> list[np.ndarray]:
        """The model's variables as a checkpoint holds them."""
        return [v.numpy() for v in self.model.variables]

    def _optimizer_arrays(self) -> list[np.ndarray]:
        """The optimizer's variables as a checkpoint holds them."""
        return [v.numpy() for v in self.optimizer.variables]

    def _global_names(self) -> dict[str, np.ndarray]:
        """``names/model`` and ``names/optimizer``: the global name of each positional entry
        (:mod:`hvdtrain.tensorflow.parts`), so that a run with pipeline stages resumes from this
        checkpoint; none when the model's layers do not hold all its variables (not a
        ``Sequential``)."""
        try:
            state = named_state(self.model.layers, 0, self.optimizer)
        except HvdtrainError:  # two variables of one name: this model has no global names
            return {}
        named = {v.path: name.split("/", 1)[1] for name, v in state.items()}
        lists = {prefix: [named.get(v.path) for v in variables] for prefix, variables in (
            ("model", self.model.variables), ("optimizer", self.optimizer.variables))}
        if any(None in names for names in lists.values()):
            return {}
        return {f"names/{prefix}": np.array(names, dtype=str) for prefix, names in lists.items()}

    def gather_state(self) -> None:
        self.exchange.gather()

    def _load_parts(self, parts: list[dict[str, Any]], where: str) -> None:
        """Loads a checkpoint written in parts by pipeline stages: every part, by global names,
        and the exchange state of every stage (its slots by variable name), merged."""
        if self.restore_from is None:
            raise HvdtrainError(f"{where}: written in parts, which lie beside it")
        entries = named_state(self.model.layers, 0, self.optimizer)
        values, named = read_parts(self.restore_from.parent, parts, entries, where)
        assign(entries, values, where)
        self.exchange.load_state_dict(self._by_index(named, where), where)

    def _by_index(self, named: dict[str, Any], where: str) -> dict[str, Any] | None:
        """The parts' merged exchange state (slots by variable name) for this model's exchange
        (slots by the index of its trainable variables)."""
        names = trainable_names(self.model.layers, 0, self.model.trainable_variables)
        if names is None:
            if any("/" in key for key in named):
                raise HvdtrainError(f"{where}: its parts' compression state is by layer, and this "
                                    "model's trainable variables are not its layers' in order")
            names = []
        return by_index(named, names)

    def load_state(self, data: bytes, where: str) -> dict[str, Any]:
        # allow_pickle=False: loading a checkpoint must never execute code from the file.
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files}
            meta = json.loads(str(arrays["meta"]))
            parted = isinstance(meta, dict) and bool(meta.get("parts")) and "shards" not in meta
            # Sharded data parallel's on a run that keeps its variables whole: from its parts.
            unsharded = isinstance(meta, dict) and meta.get("shards") is not None and (
                not self.reads_shards)
            expected = [] if parted or unsharded else [f"{prefix}/{i}" for prefix, variables in (
                ("model", self.model.variables), ("optimizer", self.optimizer.variables))
                for i in range(len(variables))]
            missing = [name for name in expected if name not in arrays]
            if missing or not isinstance(meta, dict):
                raise KeyError(f"no entry {missing[0]}" if missing else "meta is not a mapping")
        except Exception as exc:  # noqa: BLE001  (whatever the file holds: one line naming it)
            raise not_a_checkpoint(where, exc) from None
        if parted:  # written by pipeline stages: every part, by global names
            self._load_parts(meta["parts"], where)
            self._restore_rest(arrays, where)
            return meta
        if unsharded:  # one variable whole at a time (hvdtrain/tensorflow/shard_files.py)
            from hvdtrain.tensorflow.shard_files import restore_whole
            restore_whole(self.model, self.optimizer, arrays, meta, self.restore_from, where)
            self._restore_rest(arrays, where)
            return meta
        try:
            for prefix, variables in (("model", self.model.variables),
                                      ("optimizer", self.optimizer.variables)):
                for i, var in enumerate(variables):
                    self._restore(var, arrays[f"{prefix}/{i}"], f"{prefix}/{i}", where)
            self._restore_rest(arrays, where)
        except HvdtrainError:
            raise
        except Exception as exc:  # noqa: BLE001  (entries of the wrong type, or not hvdtrain's)
            raise HvdtrainError(f"{where} does not fit the model: {type(exc).__name__}: "
                                f"{(str(exc).strip().splitlines() or [''])[0][:160]}") from None
        return meta

    reads_shards = False
    """Whether this engine reads a checkpoint of shards itself (sharded data parallel's)."""

    def _restore_rest(self, arrays: dict[str, np.ndarray], where: str) -> None:
        """The random states and the exchange's state of a checkpoint's arrays."""
        states = {name[4:]: value for name, value in arrays.items() if name.startswith("rng/")}
        if states:  # absent in checkpoints written before random states were saved
            rng.restore(states)
        self.exchange.load_state_dict({name[len(COMPRESSION):]: value
                                       for name, value in arrays.items()
                                       if name.startswith(COMPRESSION)}, where)

    def _restore(self, var: Any, value: np.ndarray, name: str, where: str) -> None:
        if tuple(var.shape) != value.shape:
            raise HvdtrainError(f"{where}: {name} has shape {value.shape}, "
                                f"the model has {tuple(var.shape)}")
        var.assign(value)

    def parameters(self) -> dict[str, np.ndarray]:
        # Positions, not Keras paths: paths carry per-process counters (dense_1, dense_2, ...).
        return {f"{i}.{v.name}": v.numpy().copy()
                for i, v in enumerate(self.model.trainable_variables)}

    def versions(self) -> dict[str, str]:
        return {"tensorflow": tf.__version__, "keras": keras.__version__,
                "horovod": horovod.__version__}

    def placement(self) -> dict[str, str]:
        return summary(self.device_kind, self.gpu)
