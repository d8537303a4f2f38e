"""Metric sinks and the rank-0 discipline: every rank calls ``log``; only rank 0 writes.

Records are flat dicts of numbers. ``metrics.jsonl`` gets one JSON object per logged step; the
console gets one line per logged step and per evaluation.
"""

from __future__ import annotations

import abc
import json
import math
import sys
from pathlib import Path
from typing import Any, TextIO


class Sink(abc.ABC):
    """One destination for metric records."""

    @abc.abstractmethod
    def log(self, record: dict[str, Any]) -> None:
        """Writes one record."""

    def close(self) -> None:
        """Flushes and releases what the sink holds."""


class JsonlSink(Sink):
    """Appends one JSON object per record to a file, flushed each time so a crash loses nothing."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a")

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key == "lr":
            return f"{key}={value:.4g}"
        return f"{key}={value:.1f}" if abs(value) >= 100 else f"{key}={value:.4f}"
    return f"{key}={value}"


class ConsoleSink(Sink):
    """Plain periodic lines, readable in CI logs and Slurm output files."""

    KEYS = ("loss", "accuracy", "eval_loss", "eval_accuracy", "lr", "samples_per_sec")

    def __init__(self, total_steps: int, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout
        self._width = len(str(total_steps))
        self._total = total_steps

    def log(self, record: dict[str, Any]) -> None:
        head = f"[hvdtrain] epoch {record['epoch']} step {record['step']:>{self._width}}/{self._total}"
        body = " ".join(_fmt(k, record[k]) for k in self.KEYS if k in record)
        print(f"{head} {body}", file=self._stream, flush=True)


class MetricsLogger:
    """Fans records out to the sinks; on ranks other than 0 it holds none and does nothing."""

    def __init__(self, sinks: list[Sink]) -> None:
        self._sinks = sinks

    def log(self, record: dict[str, Any]) -> None:
        """Writes ``record`` to every sink; non-finite numbers become null in JSON."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        for sink in self._sinks:
            sink.log(clean)

    def close(self) -> None:
        """Closes every sink."""
        for sink in self._sinks:
            sink.close()
