"""Models for the elastic tests: the built-in MLP, paced so that a test can act mid-run."""

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
