"""A sink for :mod:`hvdtrain.observe.writer`'s tests, built in the child process by its import path.

It appends what it is given to a JSON-lines file, flushed per line, so that a test can read what
reached the child even while the child runs, and it notes the scheduling policy it runs under.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from hvdtrain.observe.records import Sink


class RecordingSink(Sink):
    """Writes ``{"policy": ...}``, then each record, each summary, and ``{"closed": true}``."""

    def __init__(self, path: str, fail_at: int = -1, fail_open: bool = False,
                 delay_s: float = 0.0) -> None:
        if fail_open:
            raise OSError("cannot open the event file")
        self._file = open(path, "a")  # noqa: SIM115  (closed by close(), as a sink's file is)
        self._fail_at, self._delay = fail_at, delay_s
        self._write({"policy": os.sched_getscheduler(0), "pid": os.getpid()})

    def _write(self, item: dict[str, Any]) -> None:
        self._file.write(json.dumps(item) + "\n")
        self._file.flush()

    def log(self, record: dict[str, Any]) -> None:
        if record["step"] == self._fail_at:
            raise OSError("disk full")
        time.sleep(self._delay)
        self._write(record)

    def summary(self, summary: dict[str, Any]) -> None:
        self._write({"summary": summary})

    def close(self) -> None:
        self._write({"closed": True})
        self._file.close()
