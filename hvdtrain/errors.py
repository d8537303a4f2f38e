"""The project's exception types: the CLI prints their message on one line and picks the exit code.

:class:`HvdtrainError` is a mistake in what the user asked for (exit code 2: fix the command);
:class:`EnvironmentFailure` is the machine or file system failing the run (exit code 74: fix the
environment, then resume).
"""

from __future__ import annotations

import errno
import os


class HvdtrainError(Exception):
    """A mistake in what the user asked for (config, paths, plug-ins), not a bug in hvdtrain."""


class ConfigError(HvdtrainError):
    """A config key, type or value that hvdtrain cannot accept."""


class Diverged(HvdtrainError):
    """The loss became NaN or infinite; every rank stops at the same step."""


class EnvironmentFailure(HvdtrainError):
    """The environment failed the run: a full disk, a read-only or unwritable directory, an I/O
    error. What the run saved before stays valid; after the cause is fixed, resume it."""


RESUME_ADVICE = "free space (or fix the directory), then resubmit with checkpoint.resume=auto"
"""What an :class:`EnvironmentFailure` of the run's writes (checkpoints, metrics) tells the user."""

# Errors that say the path itself is of the wrong kind (the user named a file where a directory
# belongs, or the reverse): a mistake in the command, not a failing machine.
_WRONG_KIND = (errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENOENT, errno.ENAMETOOLONG)


def os_failure(exc: OSError | ValueError, what: str, path: os.PathLike | str, advice: str,
               wrong_kind: str = "") -> HvdtrainError:
    """The one-line error for an ``OSError`` (or a ``ValueError`` such as an embedded NUL byte)
    met while working on ``path``: :class:`HvdtrainError` (with ``wrong_kind`` as its advice) when
    the path is of the wrong kind, :class:`EnvironmentFailure` (with ``advice``) otherwise: no
    space, no permission, a read-only file system, an I/O error."""
    if isinstance(exc, ValueError):
        return HvdtrainError(f"{what} {str(path)!r}: {exc}")
    reason = exc.strerror or str(exc)
    code = errno.errorcode.get(exc.errno or 0)
    detail = f"{reason} ({code})" if code else reason
    if exc.errno in _WRONG_KIND:
        hint = f"; {wrong_kind}" if wrong_kind else ""
        return HvdtrainError(f"{what} {str(path)!r}: {detail}{hint}")
    return EnvironmentFailure(f"{what} {str(path)!r}: {detail}; {advice}")
