"""Elastic mode for your own loop (docs/own-loop.md): the user's training function inside
Horovod's ``hvd.elastic.run``, on the trainer's own elastic state (:mod:`hvdtrain.elastic_mode`).

Imported only when ``elastic.enabled``, since it loads Horovod's elastic machinery. The policy is
the trainer's (:mod:`hvdtrain.elastic`): the state (the engine's checkpoint in memory, the
position, the record of the sample indices trained on, and here the ``setup`` objects) is
committed every ``elastic.commit_every`` steps at a step boundary; after a reset every rank
restarts the user's function from the last commit at the new world size, and hvdtrain's sampler
re-shards the rest of the epoch over the new ranks, so each sample is still seen once an epoch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from hvdtrain.elastic import entry_event
from hvdtrain.elastic_mode import TrainingState
from hvdtrain.session import Start


class LoopState(TrainingState):
    """The trainer's elastic state with the own-loop API's ``setup`` objects in it."""

    def __init__(self, loop: Any, start: Start) -> None:
        self.loop = loop  # before the first save, which reads the objects
        super().__init__(loop.engine, loop.cfg, start)

    def save(self) -> None:
        super().save()
        self._saved["objects"] = {name: copy.deepcopy(obj.state_dict())
                                  for name, obj in self.loop.objects.items()}

    def restore(self) -> None:
        super().restore()
        for name, obj in self.loop.objects.items():
            obj.load_state_dict(copy.deepcopy(self._saved["objects"][name]))


def run_elastic(loop: Any, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Runs ``fn(*args, **kwargs)`` (the user's loop) through Horovod's elastic runner from
    ``loop``'s elastic state, again after every reset; rank 0 then writes the index record."""
    state = loop.elastic_state
    result = loop.engine.collectives.elastic_run(_entry)(state, loop, fn, args, kwargs)
    if loop.engine.rank == 0:
        state.record.write(loop.run_dir.indices)
    return result


def _entry(state: LoopState, loop: Any, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """One entry into the user's function: from the committed state at the current size."""
    if state.error:
        raise state.error
    state.follow_world()
    engine = loop.engine
    if loop.logger is not None:  # its file is trimmed below; a new one opens on the next log
        loop.logger.close()
        loop.logger = None
    if engine.rank == 0:
        loop.run_dir.log_event(entry_event(state, engine.accumulation))
        # Steps after the commit are trained again: their records would appear twice.
        loop.run_dir.trim_metrics(state.position.step)
    loop.restart_from(state.position, reset=state.resets > 0)
    try:
        result = fn(*args, **kwargs)
        state.record.gather(engine.collectives.allgather_object)
    except Exception:
        state.failed_at = loop.position.step  # how far this rank got: the steps a reset loses
        raise
    return result
