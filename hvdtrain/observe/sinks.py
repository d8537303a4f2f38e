"""Where records go: ``metrics.jsonl``, the console, and the dashboards (TensorBoard, W&B).

:func:`hvdtrain.observe.records.make_logger` builds them by their names in
:data:`hvdtrain.registry.SINKS`. TensorBoard and W&B are built in the writer process only
(:mod:`hvdtrain.observe.writer`) and import their packages when made, so importing this module
loads neither (nor any framework). They get the numbers as scalars tagged ``train/<key>``,
``eval/<key>`` and ``system/<key>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import string
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO, cast

from hvdtrain.errors import RESUME_ADVICE, HvdtrainError, os_failure
from hvdtrain.observe.records import Sink, has_eval
from hvdtrain.rundir import RunDir


class JsonlSink(Sink):
    """Appends one JSON object per record to a file, keys in the record's order (``step``,
    ``epoch``, ``lr`` first).

    Records are held and written together at most every ``every_s`` seconds (0: each at once), and
    by :meth:`flush`, which the loop calls before each checkpoint and elastic commit and the stall
    watchdog before it ends the job, so what a resume or a reader relies on is on disk. Why: with
    the encoder and the file cold after every step, a record encoded and written alone costs rank 0
    more than its share of a batch, and every other rank waits for rank 0 at the next allreduce.
    ``flush`` may come from another thread (the watchdog's) while the training thread is stuck.

    A write that fails (a full disk) is cut back to the last whole record and raised once, as an
    :class:`~hvdtrain.errors.EnvironmentFailure` naming the file; the loop shares it with every rank
    (:meth:`hvdtrain.checkpoint.CheckpointManager.hold_failure`). The sink writes nothing after it.
    """

    def __init__(self, path: Path, every_s: float = 0.0) -> None:
        self._path = path
        try:
            # Unbuffered: a failed write leaves nothing in a buffer that closing would try again.
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as exc:
            raise os_failure(exc, "cannot write metrics", path, RESUME_ADVICE) from None
        self._every_s = every_s
        self._held: list[dict[str, Any]] = []
        self._written_at = time.monotonic()
        self._lock = threading.Lock()
        self._failed = False

    def log(self, record: dict[str, Any]) -> None:
        self._held.append(record)
        if time.monotonic() - self._written_at >= self._every_s:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            held, self._held = self._held, []
            self._written_at = time.monotonic()
            if not held or self._failed:
                return
            data = "".join(json.dumps(record) + "\n" for record in held).encode()
            try:
                append_whole(self._fd, data)
            except OSError as exc:
                self._failed = True
                raise os_failure(exc, "cannot write metrics", self._path, RESUME_ADVICE) from None

    def restart(self, step: int, total_steps: int) -> None:
        with self._lock:
            self._held = [record for record in self._held if record["step"] <= step]

    def close(self) -> None:
        try:
            self.flush()
        finally:
            os.close(self._fd)


def append_whole(fd: int, data: bytes) -> None:
    """Appends ``data`` to the file open on ``fd`` (``O_APPEND``) or, when a write fails part way
    (a full disk), cuts the file back to its length before and raises: readers never meet half a
    record written by this process."""
    start = os.lseek(fd, 0, os.SEEK_END)
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        # Shrinking a file needs no free space; should it fail anyway, the reader drops a last line
        # cut short (hvdtrain.rundir.read_records).
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key == "lr":
            return f"{key}={value:.4g}"
        return f"{key}={value:.1f}" if abs(value) >= 100 else f"{key}={value:.4f}"
    return f"{key}={value}"


def _clock(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ConsoleSink(Sink):
    """Progress on rank 0's stdout: plain periodic lines (CI logs, Slurm output files) or a bar.

    :func:`~hvdtrain.observe.records.make_logger` puts it behind a
    :class:`~hvdtrain.observe.records.ThrottledSink` (``log.console_every_s``): every line costs the
    writing rank a pipe write and a wake-up of ``horovodrun``'s forwarder, and 20 lines a second
    help nobody reading a log.

    The bar is one line redrawn in place: epoch, a bar of the run's steps, step/total, ETA, loss,
    accuracy and samples/s. It ends each redraw with a carriage return, which ``horovodrun``
    forwards as it comes (it flushes a rank's output at carriage returns as well as newlines); the
    last record of an epoch, which holds the evaluation, stays on its own line.
    """

    # The language models report perplexity where the classifiers report accuracy.
    TRAIN_KEYS = ("loss", "accuracy", "perplexity")
    EVAL_KEYS = ("eval_loss", "eval_accuracy", "eval_perplexity")
    KEYS = TRAIN_KEYS + EVAL_KEYS + ("lr", "samples_per_sec")
    BAR = 24

    def __init__(self, total_steps: int, stream: TextIO | None = None, *, epochs: int = 0,
                 bar: bool = False, start_step: int = 0) -> None:
        self._stream = stream or sys.stdout
        self._width = len(str(total_steps))
        self._total, self._epochs, self._bar, self._start = total_steps, epochs, bar, start_step
        self._drawn = 0  # length of the bar line on screen (0: none)

    def restart(self, step: int, total_steps: int) -> None:
        # The loop's clock (``time_s``) starts again at a restart, so the ETA counts from ``step``.
        self._width = max(self._width, len(str(total_steps)))
        self._total, self._start = total_steps, step

    def log(self, record: dict[str, Any]) -> None:
        if not self._bar:
            step = f"{record['step']:>{self._width}}/{self._total}"
            head = f"[hvdtrain] epoch {record['epoch']} step {step}"
            body = " ".join(_fmt(k, record[k]) for k in self.KEYS if k in record)
            print(f"{head} {body}", file=self._stream, flush=True)
            return
        line = self.bar_line(record)
        if has_eval(record):
            evals = " ".join(_fmt(k, record[k]) for k in self.EVAL_KEYS if k in record)
            self._stream.write(f"{line} {evals}".ljust(self._drawn) + "\n")
            self._drawn = 0
        else:
            self._stream.write(line.ljust(self._drawn) + "\r")
            self._drawn = len(line)
        self._stream.flush()

    def bar_line(self, record: dict[str, Any]) -> str:
        """The progress bar's text for ``record``: epoch, bar, step/total, ETA, loss, samples/s."""
        step, total = record["step"], max(self._total, 1)
        filled = self.BAR * min(step, total) // total
        done = step - self._start
        eta = record.get("time_s", 0.0) / done * (total - step) if done > 0 else 0.0
        epochs = f"/{self._epochs}" if self._epochs else ""
        parts = [f"[hvdtrain] epoch {record['epoch'] + 1}{epochs}",
                 f"|{'#' * filled}{'-' * (self.BAR - filled)}|",
                 f"{step:>{self._width}}/{self._total}", f"ETA {_clock(eta)}"]
        parts += [_fmt(k, record[k]) for k in self.TRAIN_KEYS if k in record]
        if "samples_per_sec" in record:
            parts.append(f"{record['samples_per_sec']:.0f} samples/s")
        return " ".join(parts)

    def before_warning(self) -> None:
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()
            self._drawn = 0

    def close(self) -> None:
        self.before_warning()  # leave the cursor on a fresh line


SYSTEM_KEYS = ("cpu_percent_rank", "rss_mb_rank", "gpu_util_percent_rank", "gpu_mem_mb_rank")
"""Prefixes of the per-rank system samples, tagged ``system/<key>``."""


def scalar_tags(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers under their TensorBoard and W&B tags.

    ``eval_accuracy`` becomes ``eval/accuracy``, the per-rank system samples (``cpu_percent_rank0``)
    ``system/<key>``, and every other key ``train/<key>``, so that each dashboard groups them in
    sections. ``step`` is the x axis, not a scalar; nulls (non-finite values) and lists (events) are
    left out.
    """
    tags = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key.startswith("eval_"):
            tags["eval/" + key[5:]] = float(value)
        else:
            tags[("system/" if key.startswith(SYSTEM_KEYS) else "train/") + key] = float(value)
    return tags


class TensorBoardSink(Sink):
    """TensorBoard event files in ``logdir``, one scalar per tag and logged step.

    Written with TensorBoard's own record format and protos: its ``EventFileWriter`` goes through
    ``tf.io.gfile`` and would import TensorFlow into a PyTorch run. A fresh run removes the event
    files of an earlier run in the directory (a resumed one keeps them), as ``metrics.jsonl`` is
    replaced, so that TensorBoard shows one run per directory.
    """

    def __init__(self, logdir: str | Path, fresh: bool = True) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = Event, Summary
        logdir = Path(logdir)
        # time_ns keeps the name unique when one process writes two runs into the same directory.
        stamp = f"{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{time.time_ns()}"
        self._path = logdir / f"events.out.tfevents.{stamp}"
        with self._naming_path():
            logdir.mkdir(parents=True, exist_ok=True)
            if fresh:
                for old in logdir.glob("events.out.tfevents.*"):
                    old.unlink()
            self._writer = RecordWriter(self._path.open("wb"))
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def log(self, record: dict[str, Any]) -> None:
        values = [self._summary.Value(tag=tag, simple_value=value)
                  for tag, value in scalar_tags(record).items()]
        self._write(self._event(wall_time=time.time(), step=int(record["step"]),
                                summary=self._summary(value=values)))

    def _write(self, event: Any) -> None:
        with self._naming_path():
            self._writer.write(event.SerializeToString())
            self._writer.flush()  # like metrics.jsonl: a crashed run keeps everything it logged

    def close(self) -> None:
        with self._naming_path():
            self._writer.close()

    @contextlib.contextmanager
    def _naming_path(self) -> Iterator[None]:
        """Turns an ``OSError`` (a full disk) into the one-line error naming the event file."""
        try:
            yield
        except OSError as exc:
            raise os_failure(exc, "cannot write TensorBoard events", self._path,
                             RESUME_ADVICE) from None


def wandb_run_id(run_dir: Path, resumed: bool) -> str:
    """The W&B run id of ``run_dir``: the one stored in ``wandb_id`` when the run is resumed (so it
    continues the same W&B run), otherwise a new one, which is stored for a later resume."""
    path = RunDir(run_dir).wandb_id
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
    ``WANDB_API_KEY``, which W&B reads itself, so hvdtrain never handles or writes it. W&B's error
    reports to its servers are off unless ``WANDB_ERROR_REPORTING`` is set.
    """

    def __init__(self, run_dir: str | Path, *, mode: str, project: str, name: str,
                 config: dict[str, Any], resumed: bool = False) -> None:
        if mode == "online" and not os.environ.get("WANDB_API_KEY"):
            raise HvdtrainError("log.wandb=online needs WANDB_API_KEY in the environment "
                                "(or log.wandb=offline, then `wandb sync` the run later)")
        # W&B's own error reporting loads OpenTelemetry on the first log call: CPU time taken in
        # the first second of training, to report to W&B's servers, which an offline run cannot
        # reach. Off unless the user asks for it; this runs in the writer process only.
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        self._wandb = wandb
        run_dir = Path(run_dir)
        run_id = wandb_run_id(run_dir, resumed)
        # console="off": W&B would otherwise wrap stdout and stderr, which belong to the console
        # sink and to horovodrun's per-rank output. x_disable_stats: W&B's own sampler would see
        # rank 0's machine only and take CPU from training; hvdtrain logs every rank's figures.
        # The config's choices for log.wandb are W&B modes: the str is one of W&B's literals.
        self._run = wandb.init(dir=run_dir, mode=cast(Any, mode), project=project, name=name,
                               id=run_id, resume="allow", config=config,
                               settings=wandb.Settings(console="off", quiet=True,
                                                       x_disable_stats=True))

    def log(self, record: dict[str, Any]) -> None:
        self._run.log(scalar_tags(record), step=int(record["step"]))

    def summary(self, summary: dict[str, Any]) -> None:
        self._run.summary.update(summary)

    def close(self) -> None:
        self._run.finish()
        # The service process holds the offline run's last records until it is torn down; teardown
        # also removes the WANDB_SERVICE variable that wandb.init put into this process's environ.
        self._wandb.teardown()
