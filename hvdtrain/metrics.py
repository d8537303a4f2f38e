"""Metric sinks and the rank-0 discipline: every rank calls ``log``; only rank 0 writes.

Records are flat dicts of numbers. ``metrics.jsonl`` gets one JSON object per logged step; the
console gets one line per logged step and per evaluation; TensorBoard and Weights & Biases get the
same numbers as scalars tagged ``train/<key>`` and ``eval/<key>``. Their packages are imported only
when their sink is made, so importing this module loads neither (nor any framework).
"""

from __future__ import annotations

import abc
import json
import math
import os
import secrets
import socket
import string
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from hvdtrain.errors import HvdtrainError


class Sink(abc.ABC):
    """One destination for metric records."""

    @abc.abstractmethod
    def log(self, record: dict[str, Any]) -> None:
        """Writes one record."""

    def summary(self, summary: dict[str, Any]) -> None:
        """Records the run's final summary; most sinks have no place for it."""

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


def scalar_tags(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers under their TensorBoard and W&B tags.

    ``eval_accuracy`` becomes ``eval/accuracy`` and every other key ``train/<key>``, so that each
    dashboard groups them in two sections. ``step`` is the x axis, not a scalar; nulls (non-finite
    values) are left out.
    """
    tags = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        tags["eval/" + key[5:] if key.startswith("eval_") else "train/" + key] = float(value)
    return tags


class TensorBoardSink(Sink):
    """TensorBoard event files in ``logdir``, one scalar per tag and logged step.

    Written with TensorBoard's own record format and protos: its ``EventFileWriter`` goes through
    ``tf.io.gfile`` and would import TensorFlow into a PyTorch run. A fresh run removes the event
    files of an earlier run in the directory (a resumed one keeps them), as ``metrics.jsonl`` is
    replaced, so that TensorBoard shows one run per directory.
    """

    def __init__(self, logdir: Path, fresh: bool = True) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = Event, Summary
        logdir.mkdir(parents=True, exist_ok=True)
        if fresh:
            for old in logdir.glob("events.out.tfevents.*"):
                old.unlink()
        # time_ns keeps the name unique when one process writes two runs into the same directory.
        stamp = f"{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{time.time_ns()}"
        self._writer = RecordWriter((logdir / f"events.out.tfevents.{stamp}").open("wb"))
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def log(self, record: dict[str, Any]) -> None:
        values = [self._summary.Value(tag=tag, simple_value=value)
                  for tag, value in scalar_tags(record).items()]
        self._write(self._event(wall_time=time.time(), step=int(record["step"]),
                                summary=self._summary(value=values)))

    def _write(self, event: Any) -> None:
        self._writer.write(event.SerializeToString())
        self._writer.flush()  # like metrics.jsonl: a crashed run keeps everything it logged

    def close(self) -> None:
        self._writer.close()


def wandb_run_id(run_dir: Path, resumed: bool) -> str:
    """The W&B run id of ``run_dir``: the one stored in ``wandb_id`` when the run is resumed (so it
    continues the same W&B run), otherwise a new one, which is stored for a later resume."""
    path = run_dir / "wandb_id"
    if resumed and path.exists():
        return path.read_text().strip()
    # W&B's own ids look like this (8 of [a-z0-9]); its generator is not public API.
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    path.write_text(run_id + "\n")
    return run_id


class WandbSink(Sink):
    """A Weights & Biases run with its files in ``<run_dir>/wandb/``.

    Logs ``config`` (the resolved config, which holds no credentials) at the start, every record as
    scalars at its step, and the summary as the W&B run summary. ``offline`` needs no network and
    leaves ``wandb/offline-run-*`` for ``wandb sync``; ``online`` takes the API key from
    ``WANDB_API_KEY``, which W&B reads itself, so hvdtrain never handles or writes it.
    """

    def __init__(self, run_dir: Path, *, mode: str, project: str, name: str,
                 config: dict[str, Any], resumed: bool = False) -> None:
        if mode == "online" and not os.environ.get("WANDB_API_KEY"):
            raise HvdtrainError("log.wandb=online needs WANDB_API_KEY in the environment "
                                "(or log.wandb=offline, then `wandb sync` the run later)")
        import wandb

        self._wandb = wandb
        run_id = wandb_run_id(run_dir, resumed)
        # console="off": W&B would otherwise wrap stdout and stderr, which belong to the console
        # sink and to horovodrun's per-rank output.
        self._run = wandb.init(dir=run_dir, mode=mode, project=project, name=name, id=run_id,
                               resume="allow", config=config,
                               settings=wandb.Settings(console="off", quiet=True))

    def log(self, record: dict[str, Any]) -> None:
        self._run.log(scalar_tags(record), step=int(record["step"]))

    def summary(self, summary: dict[str, Any]) -> None:
        self._run.summary.update(summary)

    def close(self) -> None:
        self._run.finish()
        # The service process holds the offline run's last records until it is torn down; teardown
        # also removes the WANDB_SERVICE variable that wandb.init put into this process's environment.
        self._wandb.teardown()


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

    def summary(self, summary: dict[str, Any]) -> None:
        """Hands the run's final summary to every sink (W&B keeps it as the run summary)."""
        for sink in self._sinks:
            sink.summary(summary)

    def close(self) -> None:
        """Closes every sink."""
        for sink in self._sinks:
            sink.close()
