"""Where Horovod's background thread spends a job's time, from Horovod's own timeline.

Run a job with ``HOROVOD_TIMELINE=PATH`` (rank 0 writes it), then::

    .venv/bin/python docs/investigations/step-overhead/timeline.py PATH --steps 20

prints, per activity (``NEGOTIATE_ALLREDUCE``, ``MEMCPY_IN_FUSION_BUFFER``, ``GLOO_ALLREDUCE``,
``MEMCPY_OUT_FUSION_BUFFER``, ...), the wall time it covered (the union of its spans over every
tensor, so a fused response counts once) in total and per step. ``ALLREDUCE`` is the whole
execution of a response; what it covers beyond its nested activities is the scaling (averaging)
pass and the op's own bookkeeping, printed as ``ALLREDUCE not nested``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

Span = tuple[float, float]
ALLREDUCE_PARTS = ("WAIT_FOR_DATA", "WAIT_FOR_OTHER_TENSOR_DATA", "INIT_FUSION_BUFFER",
                   "MEMCPY_IN_FUSION_BUFFER", "GLOO_ALLREDUCE", "MPI_ALLREDUCE",
                   "MEMCPY_OUT_FUSION_BUFFER")
"""The activities Horovod times inside an allreduce's execution (``ALLREDUCE``) on the CPU."""


def spans(events: list[dict]) -> dict[str, list[Span]]:
    """Every activity's (start, end) spans in microseconds, matched per tensor by nesting."""
    open_: dict[int, list[tuple[str, float]]] = defaultdict(list)
    out: dict[str, list[Span]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "B":
            open_[e["pid"]].append((e["name"], float(e["ts"])))
        elif e.get("ph") == "E" and open_[e["pid"]]:
            name, start = open_[e["pid"]].pop()
            out[name].append((start, float(e["ts"])))
    return out


def covered(intervals: list[Span]) -> float:
    """Microseconds covered by the union of ``intervals``."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", type=Path, help="the file HOROVOD_TIMELINE named")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps of the job (per-step column)")
    args = p.parse_args(argv)
    try:
        found = spans(json.loads(args.path.read_text()))
    except (OSError, ValueError) as e:
        print(f"timeline.py: {args.path}: not a readable Horovod timeline ({e})", file=sys.stderr)
        return 2
    times = {name: covered(s) / 1e3 for name, s in found.items()}
    nested = covered([s for name in ALLREDUCE_PARTS for s in found.get(name, [])]) / 1e3
    if "ALLREDUCE" in times:
        times["ALLREDUCE not nested"] = times["ALLREDUCE"] - nested
    print(f"{'activity':<32} {'total ms':>10} {'ms/step':>9}")
    for name, ms in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"{name:<32} {ms:>10.1f} {ms / args.steps:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
