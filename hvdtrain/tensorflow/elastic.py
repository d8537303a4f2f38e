"""TensorFlow's side of elastic mode: Horovod's TensorFlow collectives and the engine's adjustments.

Horovod's ``TensorFlowKerasState`` does not work with Keras 3 (see shared/DESIGN.md); the state is
hvdtrain's own (:class:`hvdtrain.elastic.TrainingState`), saved through the engine's checkpoint.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import hvdtrain.tensorflow  # noqa: F401  (quiets TensorFlow before it loads)
import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.common.elastic import run_fn
from horovod.common.exceptions import HorovodInternalError

from hvdtrain.elastic import ElasticBackend
from hvdtrain.engine import Engine
from hvdtrain.tensorflow import rng


def refresh(engine: Engine) -> None:
    """Reads the rank and sizes again after Horovod restarted at another world size."""
    engine.rank, engine.size = hvd.rank(), hvd.size()
    engine.local_rank, engine.local_size = hvd.local_rank(), hvd.local_size()


def set_accumulation(engine: Engine, passes: int) -> None:
    """Sets the micro-batches accumulated before each allreduce; the step functions are traced
    again, since whether they accumulate at all is decided when they are traced."""
    if engine.accumulation == passes:  # type: ignore[attr-defined]
        return
    engine.accumulation = passes  # type: ignore[attr-defined]
    if passes > 1 and not engine.accumulators:  # type: ignore[attr-defined]
        engine.accumulators = [tf.Variable(tf.zeros_like(v.value), trainable=False)  # type: ignore[attr-defined]
                               for v in engine.model.trainable_variables]  # type: ignore[attr-defined]
    engine._compile(tuple(engine.train_x.shape[1:]))  # type: ignore[attr-defined]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """``hvd.elastic.run`` for TensorFlow, with a fix: Horovod's version turns only errors that name
    a Horovod op into ``HorovodInternalError`` and silently returns None on any other
    ``UnknownError``. Here every TensorFlow error that comes from Horovod (its ops, or a collective
    after Horovod shut down because a peer died) starts the recovery, and others propagate."""
    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            if "horovod" in exc.message.lower() or "gloo" in exc.message.lower():
                raise HorovodInternalError(exc) from exc
            raise
    return run_fn(wrapper, _reset)


def _reset() -> None:
    hvd.shutdown()
    hvd.init()


def backend() -> ElasticBackend:
    """The collectives and adjustments that :mod:`hvdtrain.elastic` needs, for TensorFlow."""
    return ElasticBackend(run=run, broadcast_object=hvd.broadcast_object,
                          allgather_object=hvd.allgather_object, rank=hvd.rank, refresh=refresh,
                          set_accumulation=set_accumulation, fork_rng=rng.fork)
