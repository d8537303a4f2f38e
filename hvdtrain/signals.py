"""Stop requests by signal: SIGTERM or SIGUSR1 asks for a checkpoint and a clean exit.

The first signal only sets a flag; the loop agrees on it across ranks at its next log interval,
checkpoints at that step boundary on every rank and exits with :data:`EXIT_RESUBMIT`. A second
signal ends the process at once (exit code 128 + the signal number, as a shell reports it).
After the run, SIGUSR1 is ignored (unless the program had a handler of its own, which is restored):
a late copy must not kill a process that has finished or already stopped.

A rank's helper processes (PyTorch's data loader workers) ignore these signals and Ctrl-C's SIGINT
(:func:`ignore_in_helper`): Slurm signals every process of a step,
and a worker dead of the signal would end its rank with an error instead of the checkpoint the rank
was asked for. The rank decides, and ends its workers itself when it exits.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

EXIT_RESUBMIT = 75
"""Exit code of a run that stopped on request after a checkpoint: resubmit it to continue
(``checkpoint.resume=auto``). 75 is sysexits.h's ``EX_TEMPFAIL``: a temporary failure, try again."""

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
HELPER_IGNORES = (*SIGNALS, signal.SIGINT)
"""What a rank's helper process ignores: the stop signals, and the SIGINT that Ctrl-C sends to the
whole foreground process group."""


def ignore_in_helper() -> None:
    """Called first in a helper process of a rank (a data loader worker): ignores
    :data:`HELPER_IGNORES`, which the rank acts on; the rank shuts its helpers down on its way out
    (and kills, with SIGKILL, one that does not leave when asked). Other signals keep their effect:
    a helper killed by SIGKILL still fails its rank loudly."""
    for sig in HELPER_IGNORES:
        signal.signal(sig, signal.SIG_IGN)


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

    def __enter__(self) -> StopRequest:
        # Python delivers signals to the main thread only; elsewhere (a test runner's worker thread)
        # the run simply cannot be stopped by signal.
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            # USR1 means "checkpoint and stop", and the run is over: it has finished, failed, or
            # stopped on request (perhaps learnt from another rank through the metrics allreduce,
            # before its own copy of the signal arrived). A late USR1 must not turn that exit into
            # a death by signal, as the default action would: a requeued job would count as failed.
            late_usr1 = sig == signal.SIGUSR1 and handler in (signal.SIG_DFL, None)
            signal.signal(sig, signal.SIG_IGN if late_usr1 else handler)
