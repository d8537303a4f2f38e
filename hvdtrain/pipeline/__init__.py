"""Pipeline parallelism composed with Horovod data parallelism, framework-free.

The world's ``size`` ranks form ``size / stages`` copies of one pipeline of ``stages`` ranks
(the layout of ranks, :class:`hvdtrain.layout.Layout`, says which rank holds which stage of which
copy, and the groups of ranks that talk). The model is an ordered list of layers cut into
consecutive pieces (:mod:`~hvdtrain.pipeline.split`: balanced by parameter count, or at the layers
the config names).
:mod:`~hvdtrain.pipeline.schedules` holds what each schedule accepts, checked with the config
before anything starts (the table lives with the config section's checks,
:mod:`hvdtrain.strategies.schedules`). The frameworks' engines (``hvdtrain/torch/pipeline.py``,
and TensorFlow's) run the stages; this package imports neither framework.
"""

from __future__ import annotations

from hvdtrain.pipeline.schedules import SCHEDULES, Schedule, check_pipeline, microbatch_count
from hvdtrain.pipeline.split import balanced_bounds, explicit_bounds, layer_names, stage_bounds

__all__ = ["SCHEDULES", "Schedule", "balanced_bounds", "check_pipeline",
           "explicit_bounds", "layer_names", "microbatch_count", "stage_bounds"]
