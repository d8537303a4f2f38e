"""Horovod's TensorFlow collectives behind :class:`hvdtrain.engine.Collectives`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.common.elastic import run_fn
from horovod.common.exceptions import HorovodInternalError

from hvdtrain.engine import HorovodCollectives
from hvdtrain.shard import pieces, round_ranges


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


def any_rank(flag: bool, process_set: Any = None) -> bool:
    """Whether ``flag`` is true on any rank (of ``process_set``; default every rank): one small
    allreduce."""
    group = hvd.global_process_set if process_set is None else process_set
    total = hvd.allreduce(tf.constant([float(flag)]), op=hvd.Sum, name="hvdtrain.any_rank",
                          process_set=group)
    return float(total[0]) > 0


def _reset() -> None:
    hvd.shutdown()
    hvd.init()


SCATTER_PIECE = 1 << 20
"""Elements a rank in one round of :func:`grouped_reducescatter`'s large tensors (4 MiB of
float32). Gloo's reduce-scatter allocates two temporary copies of the whole tensor a call, which
the rounds bound; they came in when large calls returned wrong values now and then, whose cause
(Gloo overwriting its buffer under queued sends) patches/0012 fixes (docs/sharding.md)."""


def grouped_reducescatter(flats: Sequence[tf.Tensor], op: Any, compression: Any = None,
                          process_set: Any = None) -> list[tf.Tensor]:
    """``hvd.grouped_reducescatter`` of 1-D ``flats``, each rank's shard of each as Horovod's
    would give it; a tensor above :data:`SCATTER_PIECE` elements a rank goes alone, in rounds
    of at most that many per rank (each round carries every rank's next piece, so the shards
    come out where one call would put them)."""
    kwargs: dict[str, Any] = {"op": op}
    if compression is not None:
        kwargs["compression"] = compression
    if process_set is not None:
        kwargs["process_set"] = process_set
    size = process_set.size() if process_set is not None else hvd.size()
    out: list[tf.Tensor] = []
    small: list[tf.Tensor] = []

    def flush() -> None:
        if small:
            out.extend(hvd.grouped_reducescatter(list(small), **kwargs))
            small.clear()

    for flat in flats:
        total = flat.shape[0]
        # Unknown length (a gradient of dynamic shape, such as an embedding's): one call.
        if total is None or -(-int(total) // size) <= SCATTER_PIECE:
            small.append(flat)
            continue
        flush()
        got = []
        total = int(total)
        for k in range(pieces(total, size, SCATTER_PIECE)):
            ranges = round_ranges(total, size, SCATTER_PIECE, k)
            send = tf.concat([flat[lo:hi] for lo, hi in ranges], 0)
            got.append(hvd.reducescatter(send, **kwargs))
        out.append(tf.concat(got, 0))  # each round's result: this rank's next piece
    flush()
    return out
