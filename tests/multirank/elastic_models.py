"""Models for the elastic tests: the built-in MLP, paced so that a test can act mid-run, or
killing one worker at a chosen step."""

import os
import signal
import time

from hvdtrain.torch import MLP


class PacedMLP(MLP):
    """The ``mlp`` whose every training batch takes at least ``pause`` seconds more, so that a
    worker joining (which takes seconds to start) arrives while there is still training to do."""

    def __init__(self, pause: float = 0.05, **options) -> None:
        super().__init__(**options)
        self.pause = pause

    def loss_and_metrics(self, model, x, y, training: bool = True):
        if training:
            time.sleep(self.pause)
        return super().loss_and_metrics(model, x, y, training)


class DoomedMLP(MLP):
    """The ``mlp`` whose worker on host ``host`` (Horovod's ``HOROVOD_HOSTNAME``) SIGKILLs itself
    at its ``die_at``-th training micro-batch (counted from the start of the process): a worker
    lost at one chosen step, so that two elastic runs lose theirs at the same step and can be
    compared. Killing it blacklists its host, so give that host one slot."""

    def __init__(self, die_at: int = 13, host: str = "127.0.0.1", **options) -> None:
        super().__init__(**options)
        self.die_at, self.host, self.batches = die_at, host, 0

    def loss_and_metrics(self, model, x, y, training: bool = True):
        if training:
            self.batches += 1
            if self.batches == self.die_at and os.environ.get("HOROVOD_HOSTNAME") == self.host:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().loss_and_metrics(model, x, y, training)
