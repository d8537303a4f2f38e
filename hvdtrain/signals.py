"""Stop requests by signal: SIGTERM or SIGUSR1 asks for a checkpoint and a clean exit.

The first signal only sets a flag; the loop agrees on it across ranks at its next log interval,
checkpoints at that step boundary on every rank and exits with :data:`EXIT_RESUBMIT`. A second
signal ends the process at once (exit code 128 + the signal number, as a shell reports it).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

EXIT_RESUBMIT = 75
"""Exit code of a run that stopped on request after a checkpoint: resubmit it to continue
(``checkpoint.resume=auto``). 75 is ``EX_TEMPFAIL`` of sysexits.h: a temporary failure, try again."""

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Installs the handlers for the duration of a ``with`` block and remembers what arrived."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __call__(self) -> bool:
        """Whether a stop was requested."""
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            os._exit(128 + signum)  # the second signal: no checkpoint, no clean-up, now
        self.signum = signum

    def __enter__(self) -> "StopRequest":
        # Python delivers signals to the main thread only; elsewhere (a test runner's worker thread)
        # the run simply cannot be stopped by signal.
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            # After a stop the run has checkpointed and is only closing its sinks: a late duplicate
            # of the preemption signal (Slurm may deliver USR1 more than once) must not turn that
            # clean exit into a death by signal, as the default action would.
            stopped = self.signum is not None and sig == signal.SIGUSR1
            signal.signal(sig, signal.SIG_IGN if stopped else handler)
