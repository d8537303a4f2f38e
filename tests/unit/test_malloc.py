"""hvdtrain.malloc: with glibc's mmap threshold pinned, freed large blocks leave the process.

Each case runs in a fresh interpreter (the setting is for the life of a process). A 16 MiB block
freed first raises glibc's dynamic threshold above 1 MiB; then 200 blocks of 1 MiB are written
and every other one freed, so no freed block borders the heap's top, which glibc could trim. With
the threshold left dynamic the freed blocks stay resident; pinned, each was its own mapping and
leaves when freed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from hvdtrain.malloc import return_freed_blocks

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's setting")]

PROBE = """
import ctypes, ctypes.util, sys
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "pin":
    from hvdtrain.malloc import return_freed_blocks
    assert return_freed_blocks()
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
libc.free(libc.malloc(16 << 20))
freed, kept = [], []
for i in range(200):
    block = libc.malloc(1 << 20)
    ctypes.memset(block, 1, 1 << 20)
    (freed if i % 2 else kept).append(block)
before = rss_mib()
for block in freed:
    libc.free(block)
print(before - rss_mib())
"""


def released_mib(mode: str) -> float:
    """MiB of resident memory that freeing 100 scattered 1 MiB blocks gave back."""
    env = {"PATH": "/usr/bin:/bin"}  # no MALLOC_MMAP_THRESHOLD_ from the caller's environment
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True, env=env)
    return float(out.stdout)


def test_freed_blocks_leave_only_with_the_threshold_pinned():
    assert released_mib("none") < 10
    assert released_mib("pin") > 90


def test_the_users_own_setting_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert return_freed_blocks() is False
