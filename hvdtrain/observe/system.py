"""System samples: this process's CPU and resident memory, and its GPU through NVML if any.

Each rank samples itself once per log interval; :class:`hvdtrain.observe.ranks.Monitor` sends the
samples through the metrics allreduce. Framework-free.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any


def process_age_s() -> float | None:
    """Seconds since this process started (``None`` where there is no ``/proc``).

    From ``/proc/self/stat``'s start time, in clock ticks since boot, against the boot-time clock:
    so it covers the interpreter's start and every import before hvdtrain's own code ran.
    """
    try:
        with open("/proc/self/stat", "rb") as fileobj:
            stat = fileobj.read()
    except OSError:
        return None
    # Fields after the command name, which is in parentheses and may hold spaces: the 22nd field
    # (start time) is the 20th after it.
    start_ticks = int(stat[stat.rindex(b")") + 2:].split()[19])
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")


class SystemSampler:
    """CPU utilisation and resident memory of this process, and its GPU through NVML if any.

    ``cpu`` is percent of one core since the previous sample (200 = two cores busy): the process's
    CPU time (every thread, user and system) over the wall time between samples. ``rss`` is read
    from ``/proc/self/statm`` (absent where there is no ``/proc``). Not ``psutil``: it re-reads
    ``/proc`` and ``/sys`` several times a call to guard against pid reuse, and every rank pays for
    a sample before the metrics allreduce. NVML is used only when ``pynvml`` imports and finds a
    device; any failure turns GPU sampling off quietly.
    """

    def __init__(self, local_rank: int) -> None:
        self._page_mb = os.sysconf("SC_PAGE_SIZE") / 2**20
        # Opened once: re-reading an open /proc file is far cheaper than opening it again.
        try:
            self._statm: int | None = os.open("/proc/self/statm", os.O_RDONLY)
            weakref.finalize(self, os.close, self._statm)
        except OSError:  # not Linux: no resident memory figure
            self._statm = None
        self._wall, self._cpu = time.monotonic(), time.process_time()
        self._nvml = _nvml_handle(local_rank)

    def sample(self) -> dict[str, float]:
        """The current readings: ``cpu`` and ``rss``, and ``gpu`` and ``gpu_mem`` with a GPU."""
        wall, cpu = time.monotonic(), time.process_time()
        elapsed = wall - self._wall
        out = {"cpu": 100.0 * (cpu - self._cpu) / elapsed if elapsed > 0 else 0.0}
        self._wall, self._cpu = wall, cpu
        if self._statm is not None:
            # statm: sizes in pages; the second field is the resident set.
            out["rss"] = int(os.pread(self._statm, 256, 0).split()[1]) * self._page_mb
        if self._nvml is not None:
            try:
                nvml, handle = self._nvml
                out["gpu"] = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                out["gpu_mem"] = nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
            except Exception:  # noqa: BLE001  (a driver hiccup must not end training; stop asking)
                self._nvml = None
        return out


def _nvml_handle(local_rank: int) -> tuple[Any, Any] | None:
    """``(pynvml, device handle)`` of this rank's GPU, or None without pynvml, driver or device."""
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        ids = [int(v) for v in visible.split(",") if v.strip().isdigit()]
        count = pynvml.nvmlDeviceGetCount()
        if not count:
            return None
        # NVML numbers all devices; CUDA_VISIBLE_DEVICES, when set, says which ones this job has.
        index = ids[local_rank % len(ids)] if ids else local_rank % count
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001  (ImportError, NVMLError: no GPU metrics, nothing else changes)
        return None
