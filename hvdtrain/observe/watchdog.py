"""The stall watchdog: when no step ends in time, name the ranks that stopped, dump stacks, exit.

A hung rank (stuck in its data or model code, or in native code) leaves every other rank waiting in
the next collective, forever. Every rank runs a watchdog thread. When its rank has made no progress
(:meth:`StallWatchdog.beat`, after every step and evaluation) for ``timeout_s``, it:

1. looks at where its main thread is: inside a Horovod call means "waiting for the others", anywhere
   else means "stopped here", and writes that to ``stall-rank<r>.json`` in the run directory;
2. writes every thread's stack to ``stacks-rank<r>.txt``;
3. waits briefly for the other ranks' notes (they stall at about the same time, since they wait for
   the same rank) and the lowest rank that has a note writes the verdict to ``stall.txt`` and
   stderr: which ranks stopped and where, and which wait for them;
4. calls its ``before_exit`` (rank 0 writes out the metrics records it holds, the last ones
   before the stall) and exits with code 1, and the launcher ends the other ranks: the job fails
   instead of hanging.

A rank whose Python is blocked for good (native code holding the GIL) writes no note; it is
reported as stopped, and ``faulthandler`` (a C thread, armed as a backstop a little later) still
writes its stacks and ends it. The notes travel through the run directory, so ranks on hosts that
do not share it each report what they see.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import IO, Any

from hvdtrain.rundir import RunDir

EXIT_STALL = 1


def _horovod_dir() -> str:
    # find_spec of a top-level package locates it without importing it.
    spec = importlib.util.find_spec("horovod")
    origin = spec.origin if spec and spec.origin else ""
    return str(Path(origin).parent) + os.sep if origin else os.sep + "horovod" + os.sep


HOROVOD_DIR = _horovod_dir()


def where(frame: FrameType | None) -> tuple[bool, str]:
    """``(waiting, location)`` of a thread from its innermost frame: ``waiting`` when it is inside
    Horovod, and the innermost frame outside Horovod as ``function (file:line)``."""
    waiting, location = False, "unknown"
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(HOROVOD_DIR):
            waiting = True
        else:
            location = f"{code.co_name} ({code.co_filename}:{frame.f_lineno})"
            break
        frame = frame.f_back
    return waiting, location


def verdict(notes: dict[int, dict[str, Any]], size: int, timeout_s: float) -> str:
    """The stall report from the ranks' notes: who stopped (and where), who waits for them."""
    missing = [r for r in range(size) if r not in notes]
    stopped = [r for r, n in sorted(notes.items()) if not n["waiting"]]
    waiting = [r for r, n in sorted(notes.items()) if n["waiting"]]
    parts = [f"stall: no step or evaluation finished for {timeout_s:g} s (train.stall_timeout_s)."]
    for rank in stopped:
        note = notes[rank]
        parts.append(f"Rank {rank} ({note['host']}, pid {note['pid']}) stopped in "
                     f"{note['location']}.")
    if missing:
        parts.append(f"Rank(s) {_ranks(missing)} sent no report (blocked in native code, or on a "
                     "host that does not share the run directory): they stopped.")
    if waiting:
        whom = "them" if stopped or missing else "a collective that not every rank started"
        parts.append(f"Rank(s) {_ranks(waiting)} wait for {whom} in Horovod.")
    parts.append("Stacks: stacks-rank<r>.txt in the run directory.")
    return " ".join(parts)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


class StallWatchdog:
    """Re-armed by :meth:`beat` after every step and evaluation; disarmed on leaving the block.

    ``timeout_s`` of no progress is a stall (0: no watchdog). Notes, stacks and the verdict go to
    ``run_dir``; ``rank`` and ``size`` say which rank this is and how many notes to wait for.
    ``before_exit`` is called on the watchdog's thread just before a stall ends the process (an
    error in it is printed as a warning: the stall is the error to report).
    """

    def __init__(self, timeout_s: float, run_dir: RunDir, rank: int, size: int = 1, *,
                 before_exit: Callable[[], None] = lambda: None) -> None:
        self.timeout_s, self.run_dir, self.rank, self.size = timeout_s, run_dir, rank, size
        self._before_exit = before_exit
        self.path = run_dir.stacks(rank)
        # Long enough for every stalled rank to note where it is; short against the timeout.
        self.grace_s = min(max(timeout_s / 2, 2.0), 15.0)
        self._file: IO[str] | None = None
        self._last = self._armed = 0.0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._main = threading.main_thread().ident

    def __enter__(self) -> StallWatchdog:
        if self.timeout_s > 0:
            self.run_dir.create()  # or a one-line error, the same on every rank
            self._note_path(self.rank).unlink(missing_ok=True)  # an earlier run's
            if self.rank == 0:
                self.run_dir.stall_report.unlink(missing_ok=True)
            self._file = self.path.open("w")
            self._file.write(f"hvdtrain: rank {self.rank} (pid {os.getpid()}) finished no step or "
                             f"evaluation within {self.timeout_s:g} s (train.stall_timeout_s); "
                             "its threads' stacks follow.\n")
            self._file.flush()
            self.beat()
            self._thread = threading.Thread(target=self._watch, name="hvdtrain-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def beat(self) -> None:
        """Restarts the countdown: called whenever the rank made progress. Costs a clock read; the
        ``faulthandler`` backstop is re-armed at most once a second."""
        if self._file is None:
            return
        self._last = time.monotonic()
        if self._last - self._armed > 1.0:
            self._armed = self._last
            # The backstop fires only if the watchdog thread could not act (the GIL held for good).
            faulthandler.dump_traceback_later(self.timeout_s + 2 * self.grace_s + 5, exit=True,
                                              file=self._file)

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while not self._done.wait(poll):
            if time.monotonic() - self._last > self.timeout_s:
                self._report()

    def _note_path(self, rank: int) -> Path:
        return self.run_dir.stall_note(rank)

    def _report(self) -> None:
        # sys._current_frames: private by its name, yet documented, and the way to peek.
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        waiting, location = where(frame)
        note = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                "waiting": waiting, "location": location,
                "idle_s": round(time.monotonic() - self._last, 1)}
        tmp = self._note_path(self.rank).with_suffix(".tmp")
        tmp.write_text(json.dumps(note) + "\n")
        tmp.replace(self._note_path(self.rank))  # atomic: readers never see half a note
        assert self._file is not None
        faulthandler.dump_traceback(self._file, all_threads=True)
        self._file.flush()
        notes = self._gather()
        if min(notes) == self.rank:
            text = verdict(notes, self.size, self.timeout_s)
            self.run_dir.stall_report.write_text(text + "\n")
            print(f"hvdtrain: error: {text}", file=sys.stderr, flush=True)
        else:  # let the reporting rank finish before this exit makes the launcher end the job
            self._wait_for(self.run_dir.stall_report.exists)
        try:
            self._before_exit()
        except Exception as exc:  # noqa: BLE001  (the stall is the error to report, and exit)
            print(f"hvdtrain: warning: at the stall exit: {exc}", file=sys.stderr, flush=True)
        state = "waiting in Horovod" if waiting else f"stopped in {location}"
        print(f"hvdtrain: rank {self.rank} stalled, {state}; stacks in {self.path}",
              file=sys.stderr, flush=True)
        os._exit(EXIT_STALL)

    def _gather(self) -> dict[int, dict[str, Any]]:
        """The notes of every rank that wrote one within the grace period."""
        self._wait_for(lambda: all(self._note_path(r).exists() for r in range(self.size)))
        notes = {}
        for rank in range(self.size):
            try:
                notes[rank] = json.loads(self._note_path(rank).read_text())
            except (OSError, ValueError):
                continue
        return notes

    def _wait_for(self, done: Any) -> None:
        deadline = time.monotonic() + self.grace_s
        while not done() and time.monotonic() < deadline:
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._done.set()
            if self._thread is not None:
                self._thread.join(timeout=5)
            faulthandler.cancel_dump_traceback_later()
            self._file.close()
            self.path.unlink(missing_ok=True)  # no stall: nothing to report
