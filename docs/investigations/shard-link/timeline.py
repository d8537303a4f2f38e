"""Per-round profile of a Horovod timeline (``HOROVOD_TIMELINE``, rank 0's): for each family of
collectives (the rounds of hvdtrain's shard collectives grouped by name), the rounds' own time
on the wire, the negotiation wait, and the gaps between one round's end and the next one's
start (those under 200 ms: within a burst of rounds), with their percentiles.

The stage-2 job behind README.md's profile, on the shaped nodes (``HOROVOD_TIMELINE`` reaches
the ranks through horovodrun's environment)::

    HOROVOD_TIMELINE=/tmp/tl_stage2.json .venv/bin/python -c "import sys; sys.path.insert(0, 'benchmarks'); \
        import ps_links; ps_links.cluster('start', '2', '--bandwidth', '100mbit'); \
        print(ps_links.step_time(2, 0, 5, 400, 'gloo', ('shard.stage=2', 'shard.piece_kib=128'))); \
        ps_links.cluster('stop')"
    python3 docs/investigations/shard-link/timeline.py /tmp/tl_stage2.json
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict

Span = tuple[str, str, int, int]
"""(tensor name, activity, start, end), microseconds."""


def spans(path: str) -> list[Span]:
    """The top-level activities of every tensor (its NEGOTIATE_* and its collective)."""
    with open(path) as handle:
        text = handle.read().strip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    names = {e["pid"]: e["args"].get("name", str(e["pid"])) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    depth: dict[int, int] = defaultdict(int)
    opened: dict[int, tuple[str, int]] = {}
    found: list[Span] = []
    for e in events:
        pid = e.get("pid")
        if e.get("ph") == "B":
            depth[pid] += 1
            if depth[pid] == 1:
                opened[pid] = (e.get("name", ""), e["ts"])
        elif e.get("ph") == "E":
            if depth[pid] == 1 and pid in opened:
                kind, start = opened.pop(pid)
                found.append((names.get(pid, str(pid)), kind, start, e["ts"]))
            depth[pid] = max(0, depth[pid] - 1)
    return found


def family(tensor: str) -> str:
    """A round's tensor name without its round and unit numbers."""
    if re.search(r"shard\.(scatter|params|gather)\.", tensor):
        tensor = re.sub(r"\.\d+$", "", tensor)
    return re.sub(r"\.\d+", ".N", tensor)


def percentiles(values: list[float]) -> str:
    """p10, p50 and p90 of ``values``."""
    v = sorted(values)
    return " ".join(f"p{p} {v[int(p / 100 * (len(v) - 1))]:.2f}" for p in (10, 50, 90))


def main() -> None:
    found = spans(sys.argv[1])
    negotiation = {t: b - a for t, k, a, b in found if k.startswith("NEGOTIATE")}
    by: dict[str, list[Span]] = defaultdict(list)
    for span in found:
        if not span[1].startswith("NEGOTIATE"):
            by[family(span[0])].append(span)
    for name, xs in sorted(by.items(), key=lambda kv: -len(kv[1])):
        if len(xs) < 10:
            continue
        xs.sort(key=lambda s: s[2])
        wire = [(b - a) / 1e3 for _, _, a, b in xs]
        gaps = [g for g in ((xs[i + 1][2] - xs[i][3]) / 1e3 for i in range(len(xs) - 1))
                if g < 200]
        waits = [negotiation.get(t, 0) / 1e3 for t, _, _, _ in xs]
        print(f"{name}: {len(xs)} rounds ({xs[0][1]}); ms a round: op {percentiles(wire)}, "
              f"total {sum(wire) / 1e3:.2f} s; gap to the next {percentiles(gaps)}, total "
              f"{sum(gaps) / 1e3:.2f} s; negotiation median {statistics.median(waits):.2f}")


if __name__ == "__main__":
    main()
