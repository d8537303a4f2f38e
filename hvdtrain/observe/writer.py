"""The dashboards' writer process: :class:`SinkProcess` on rank 0, :func:`serve` in the child.

TensorBoard's protobufs and W&B's ``run.log`` cost milliseconds of Python per record. Run in the
training process, even on a thread of their own, they hold the GIL while rank 0's training thread
needs it, and every other rank waits for rank 0 at the next allreduce. In a child process they
cost the training process one JSON line written to a pipe per record, and the child runs in
Linux's idle scheduling class (:func:`lower_priority`), so where training keeps every core busy it
works in the gaps (the allreduce waits) instead of taking turns with training.

The child is ``python -m hvdtrain.observe.writer``: it finds hvdtrain the way the parent's
interpreter does, installed or not. The protocol, one JSON object per line on the child's stdin:
first ``{"sinks": [[name, kwargs], ...]}`` (``name`` is a :data:`hvdtrain.registry.SINKS` name or
the ``"module:Class"`` of a :class:`hvdtrain.observe.records.Sink`), then ``{"log": record}`` or
``{"summary": summary}`` per call. The child answers on its stdout with ``ready`` once its sinks
are built, and ``error <message as JSON>`` when one fails (``failure <message as JSON>`` when
the file system failed it: a full disk; the parent raises that as an
:class:`~hvdtrain.errors.EnvironmentFailure`). At the end of its stdin (``close``, or
the death of the parent) it closes its sinks and exits, so a parent killed by a signal still
leaves complete TensorBoard and W&B files behind. Framework-free.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import IO, Any

from hvdtrain.errors import RESUME_ADVICE, EnvironmentFailure, HvdtrainError, os_failure
from hvdtrain.registry import SINKS

NICE = 10
"""Added to the child's niceness: training comes first when the cores are all busy."""
PIPE_BYTES = 1 << 20
"""The record pipe's capacity (Linux's default for unprivileged users at most): hundreds of records
of slack before a write would wait for a child that has fallen behind."""
CLOSE_TIMEOUT_S = 300.0
"""How long ``close`` waits for the child to drain and close its sinks (W&B's final sync)."""

Spec = tuple[str, dict[str, Any]]
"""A sink to build in the child: ``(SINKS name or "module:Class", keyword arguments)``,
JSON-serialisable."""


class SinkProcess:
    """Rank 0's handle on the child: the :class:`~hvdtrain.observe.records.Sink` interface over a
    pipe.

    Construction waits until the child has built its sinks (W&B's ``init`` talks to its service),
    so that a bad setting fails before training starts. A sink's error in the child is raised, as an
    :class:`HvdtrainError` with its message, by the next call after it.
    """

    def __init__(self, specs: Sequence[Spec]) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "hvdtrain.observe.writer"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin, self._stdout = self._proc.stdin, self._proc.stdout
        self._raised = False  # the child's error has been raised; close does not raise it again
        _grow_pipe(self._stdin)
        self._send({"sinks": [list(spec) for spec in specs]})
        answer = self._stdout.readline().strip()
        if answer != "ready":
            self._stdin.close()
            self._proc.wait()
            raise self._failure([answer])

    def log(self, record: dict[str, Any]) -> None:
        """Hands one record to the child."""
        self._check()
        self._send({"log": record})

    def summary(self, summary: dict[str, Any]) -> None:
        """Hands the run's summary to the child."""
        self._check()
        self._send({"summary": summary})

    def flush(self) -> None:
        """Nothing: every record was sent as it came, and the child writes it when it arrives."""

    def restart(self, step: int, total_steps: int) -> None:
        """Nothing: the child holds no record back and shows no progress."""

    def before_warning(self) -> None:
        """Nothing: the child writes nothing to the console."""

    def close(self) -> None:
        """Ends the child's input, waits until it has closed its sinks; raises its first error."""
        if not self._stdin.closed:
            with contextlib.suppress(BrokenPipeError):  # the child is gone; its answer says why
                self._stdin.close()
        try:
            self._proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            raise HvdtrainError(f"the metrics writer (TensorBoard, W&B) did not finish within "
                                f"{CLOSE_TIMEOUT_S:.0f} s of the end of training; killed it"
                                ) from None
        lines = self._stdout.read().splitlines()
        if (lines or self._proc.returncode) and not self._raised:
            raise self._failure(lines)

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self._stdin.write(json.dumps(message) + "\n")
            self._stdin.flush()  # now: the child writes each record as it comes
        except BrokenPipeError:
            self._proc.wait()
            raise self._failure(self._stdout.read().splitlines()) from None

    def _check(self) -> None:
        """Raises the child's error if it has reported one (a poll of its stdout, no waiting)."""
        if select.select([self._stdout], [], [], 0)[0]:
            line = self._stdout.readline()
            raise self._failure([line])

    def _failure(self, lines: list[str]) -> HvdtrainError:
        self._raised = True
        for line in lines:
            kind, _, message = line.partition(" ")
            if kind in _KINDS:
                return _KINDS[kind](f"metrics writer: {json.loads(message)}")
        code = self._proc.poll()
        return HvdtrainError(f"the metrics writer process (TensorBoard, W&B) ended early "
                             f"(exit status {code}); see its messages above")


_KINDS: dict[str, type[HvdtrainError]] = {"error": HvdtrainError, "failure": EnvironmentFailure}
"""The child's answer for a failed sink -> the error the parent raises."""


def _grow_pipe(pipe: IO[str]) -> None:
    # AttributeError: not Linux (no F_SETPIPE_SZ); OSError: over the system's limit. The default
    # size remains either way.
    with contextlib.suppress(AttributeError, OSError):
        fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)


def lower_priority() -> None:
    """Puts this process (and the W&B service it starts) in Linux's idle class: it runs when a core
    has nothing else to run, and never preempts training; elsewhere, or if refused, nice +10."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(NICE)


def serve(stdin: IO[str], stdout: IO[str]) -> int:
    """The child's loop: builds the sinks, writes every record to each, closes them at the end of
    input; returns the exit status (1 after any error)."""

    def report(exc: BaseException) -> None:
        if isinstance(exc, OSError) and exc.filename is not None:  # the file system's failure
            exc = os_failure(exc, "cannot write", exc.filename, RESUME_ADVICE)
        message = str(exc) if isinstance(exc, HvdtrainError) else f"{type(exc).__name__}: {exc}"
        kind = "failure" if isinstance(exc, EnvironmentFailure) else "error"
        stdout.write(f"{kind} {json.dumps(message)}\n")
        stdout.flush()

    try:
        specs = json.loads(stdin.readline())["sinks"]
        sinks = [SINKS.get(name)(**kwargs) for name, kwargs in specs]
    except Exception as exc:  # noqa: BLE001  (reported to the parent, which raises it)
        report(exc)
        return 1
    stdout.write("ready\n")
    stdout.flush()
    failed = False
    for line in stdin:
        if failed:  # keep reading, so that the parent never waits on a full pipe
            continue
        message = json.loads(line)
        try:
            for sink in sinks:
                if "log" in message:
                    sink.log(message["log"])
                else:
                    sink.summary(message["summary"])
        except Exception as exc:  # noqa: BLE001
            report(exc)
            failed = True
    for sink in sinks:
        try:
            sink.close()
        except Exception as exc:  # noqa: BLE001
            if not failed:
                report(exc)
            failed = True
    return 1 if failed else 0


def main() -> int:
    """Entry point of the child (``python -m hvdtrain.observe.writer``)."""
    # First, so that W&B's service process, started by wandb.init, inherits the idle class too.
    lower_priority()
    # Signals meant for the job (Ctrl-C, Slurm's USR1 and TERM) are the parent's to act on; the
    # child ends when its input does, after writing everything it was given.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    # The answers get a descriptor of their own; whatever a library prints goes to stderr, where it
    # cannot be taken for one.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return serve(sys.stdin, answers)


if __name__ == "__main__":
    sys.exit(main())
