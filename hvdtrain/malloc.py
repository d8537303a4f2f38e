"""The C allocator's settings that decide whether freed memory leaves the process.

glibc serves a block above its mmap threshold with its own mapping, unmapped when freed, and a
smaller one from the heap, which keeps it. The threshold starts at 128 KiB but rises to the size
of every mapped block freed (up to 32 MiB), so after a few freed unit buffers a sharded run's
gathered parameters and gradients, which come and go every step, are kept by the heap and count
in the process's resident memory as if the model were whole. Pinning the threshold (as the
``MALLOC_MMAP_THRESHOLD_`` variable does at start-up) keeps large blocks mapped, so they leave
when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 128 * 1024
"""glibc's initial threshold, kept fixed."""


def return_freed_blocks(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pins glibc's mmap threshold at ``threshold`` bytes so that freed large blocks go back to
    the system; returns whether it was set. A no-op where the C library is not glibc, or where
    the user set ``MALLOC_MMAP_THRESHOLD_`` (theirs wins)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:  # not glibc (macOS, musl without it)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
