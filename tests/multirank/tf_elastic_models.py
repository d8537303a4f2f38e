"""TensorFlow models for the elastic tests: the built-in MLP killing one worker at a chosen step,
or paced so that a test can act mid-run."""

import os
import signal
import time

import tensorflow as tf

from hvdtrain.tensorflow.models import MLP


class DoomedMLP(MLP):
    """The ``mlp`` whose worker on host ``host`` (Horovod's ``HOROVOD_HOSTNAME``) SIGKILLs itself
    at its ``die_at``-th training micro-batch (counted from the start of the process), as
    :class:`tests.multirank.elastic_models.DoomedMLP` does in PyTorch. The step is a traced
    function, so the count runs in a ``tf.py_function`` (stateful: every call of the traced step
    runs it)."""

    def __init__(self, die_at: int = 13, host: str = "127.0.0.1", **options) -> None:
        super().__init__(**options)
        self.die_at, self.host, self.batches = die_at, host, 0

    def _count(self) -> int:
        self.batches += 1
        if self.batches == self.die_at and os.environ.get("HOROVOD_HOSTNAME") == self.host:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.batches

    def loss_and_metrics(self, model, x, y, training: bool = True):
        if training:
            tf.py_function(self._count, [], tf.int64)
        return super().loss_and_metrics(model, x, y, training)


class PacedMLP(MLP):
    """The ``mlp`` whose every training batch takes at least ``pause`` seconds more (a
    ``tf.py_function`` in the traced step), so that a worker joining (which takes seconds to
    start) arrives while there is still training to do, as
    :class:`tests.multirank.elastic_models.PacedMLP` in PyTorch."""

    def __init__(self, pause: float = 0.05, **options) -> None:
        super().__init__(**options)
        self.pause = pause

    def _sleep(self) -> float:
        time.sleep(self.pause)
        return self.pause

    def loss_and_metrics(self, model, x, y, training: bool = True):
        if training:
            tf.py_function(self._sleep, [], tf.float64)
        return super().loss_and_metrics(model, x, y, training)
