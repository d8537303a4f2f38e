"""The stall watchdog: a rank that finishes no step in time dumps its stacks and ends.

A hung collective (a dead peer, a rank stuck in its data or model code) would otherwise leave every
rank waiting forever. ``faulthandler`` does the work from a C thread, so it fires even while Python
is blocked inside Horovod: it writes every thread's stack to ``stacks-rank<r>.txt`` in the run
directory and exits the process with code 1, and the launcher then ends the other ranks.
"""

from __future__ import annotations

import faulthandler
import os
from pathlib import Path
from typing import IO


class StallWatchdog:
    """Re-armed by :meth:`beat` after every step and evaluation; disarmed on leaving the block."""

    def __init__(self, timeout_s: float, path: Path, rank: int) -> None:
        self.timeout_s, self.path, self.rank = timeout_s, path, rank
        self._file: IO[str] | None = None

    def __enter__(self) -> "StallWatchdog":
        if self.timeout_s > 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w")
            self._file.write(f"hvdtrain: rank {self.rank} (pid {os.getpid()}) finished no step or "
                             f"evaluation within {self.timeout_s:g} s (train.stall_timeout_s); "
                             "its threads' stacks follow.\n")
            self._file.flush()
            self.beat()
        return self

    def beat(self) -> None:
        """Restarts the countdown: called whenever the rank made progress."""
        if self._file is not None:
            faulthandler.cancel_dump_traceback_later()
            faulthandler.dump_traceback_later(self.timeout_s, exit=True, file=self._file)

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            faulthandler.cancel_dump_traceback_later()
            self._file.close()
            self.path.unlink(missing_ok=True)  # no stall: nothing to report
