"""The pipeline schedules, for the pipeline package: the table and its checks are the
``pipeline`` config section's, in :mod:`hvdtrain.strategies.schedules` (where the config reads
them without importing this package); this module re-exports them under the name the engines and
the planner import."""

from __future__ import annotations

from hvdtrain.strategies.schedules import (
    SCHEDULE_NAMES,
    SCHEDULES,
    Schedule,
    check_pipeline,
    microbatch_count,
)

__all__ = ["SCHEDULES", "SCHEDULE_NAMES", "Schedule", "check_pipeline", "microbatch_count"]
