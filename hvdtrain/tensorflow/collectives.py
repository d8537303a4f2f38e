"""Horovod's TensorFlow collectives behind :class:`hvdtrain.engine.Collectives`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.common.elastic import run_fn
from horovod.common.exceptions import HorovodInternalError

from hvdtrain.engine import HorovodCollectives


class TensorFlowCollectives(HorovodCollectives):
    """``horovod.tensorflow``'s collectives; see :class:`hvdtrain.engine.Collectives`."""

    def __init__(self) -> None:
        super().__init__(hvd)

    def start_allreduce_sums(self, sums: dict[str, float]) -> Callable[[], dict[str, float]]:
        # Eager Horovod ops in TensorFlow complete before they return: nothing is left to wait for.
        keys = sorted(sums)
        values = tf.constant([sums[k] for k in keys], tf.float64)
        summed = hvd.allreduce(values, op=hvd.Sum, name="hvdtrain.sums").numpy().tolist()
        total = dict(zip(keys, summed, strict=True))
        return lambda: total

    def elastic_run(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """``hvd.elastic.run`` for TensorFlow, with a fix: Horovod's version turns only errors that
        name a Horovod op into ``HorovodInternalError`` and silently returns None on any other
        ``UnknownError``. Here every TensorFlow error that comes from Horovod (its ops, or a
        collective after Horovod shut down because a peer died) starts the recovery, and others
        propagate."""
        @functools.wraps(func)
        def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return func(state, *args, **kwargs)
            except tf.errors.OpError as exc:
                if "horovod" in exc.message.lower() or "gloo" in exc.message.lower():
                    raise HorovodInternalError(exc) from exc
                raise
        return run_fn(wrapper, _reset)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank (one small allreduce)."""
    total = hvd.allreduce(tf.constant([float(flag)]), op=hvd.Sum, name="hvdtrain.any_rank")
    return float(total[0]) > 0


def _reset() -> None:
    hvd.shutdown()
    hvd.init()
