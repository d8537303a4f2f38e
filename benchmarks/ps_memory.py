"""Optimizer memory per rank: the ring against the sharded update (once colocated servers).

For N = 2 and 4 ranks (``horovodrun --gloo``), the ring (``comm.topology=ring``) and the
sharded update (``shard.stage=1``; its rows keep the name ``colocated``) each train a wide
MLP on digits (64-4096-4096-10: 17.1 M parameters) with Adam for a few steps, one job a
setting, the settings interleaved in rounds. Every rank reports the bytes of the optimizer state it holds (the
tensors in its optimizer's ``state``) and its peak resident memory (``summary.json``'s
``peak_rss_mb``). Checkpoints are off: gathering the state for one would add the whole state
to rank 0's peak. Target: colocated optimizer state per rank = ring's / N (within 1%: Horovod's
split gives the first ranks one element more).

Usage (from the repository root; about 3 minutes on 2 cores)::

    .venv/bin/python benchmarks/ps_memory.py
    .venv/bin/python benchmarks/ps_memory.py --quick --no-write   # a small model, one round
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness

sys.path.insert(0, str(harness.ROOT))  # this checkout's hvdtrain, even where none is installed

SIZES = {"rounds": (2, 1), "steps": (3, 2), "hidden": (4096, 256)}
RANKS = (2, 4)
PLACEMENTS = {"ring": [], "colocated": ["shard.stage=1"]}
TOLERANCE = 0.01


def worker(out: str, hidden: int, steps: int, overrides: Sequence[str]) -> None:
    """Under horovodrun: trains once and prints this rank's record (one JSON line)."""
    from hvdtrain.config import load_config
    from hvdtrain.driver import train

    cfg = load_config(harness.ROOT / "configs" / "digits_torch.yaml", [
        f"model.options.hidden=[{hidden},{hidden}]", "optim.name=adam", "data.batch_size=8",
        f"train.max_steps={steps}", "checkpoint.enabled=false", "checkpoint.every_steps=0",
        "log.console=false",
        "log.wandb=disabled", "log.tensorboard=false", f"log.dir={out}", "log.overwrite=true",
        *overrides], environ={})
    result = train(cfg)
    engine = result.engine
    state = sum(v.numel() * v.element_size() for entry in engine.optimizer.state.values()
                for v in entry.values() if hasattr(v, "numel"))
    params = sum(p.numel() for p in engine.model.parameters())
    print(json.dumps({"state_bytes": state, "rank": engine.rank, "params": params,
                      "peak_rss_mb": result.summary["peak_rss_mb"][engine.rank]}), flush=True)


def measure(args: Any) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Every rank's records, by (placement, ranks), over the rounds."""
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    settings = [(name, n) for n in RANKS for name in PLACEMENTS]
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-psmem-") as tmp:
        for index in range(args.rounds):
            for name, n in harness.round_order(settings, index):
                argv = [harness.horovodrun(), "-np", str(n), "--gloo", str(harness.python()),
                        __file__, "--worker", str(Path(tmp) / f"{name}-{n}"), str(args.hidden),
                        str(args.steps), *PLACEMENTS[name]]
                records = harness.run_job(argv, "state_bytes", args.timeout)
                results.setdefault((name, n), []).extend(records)
    return results


def table(results: dict[tuple[str, int], list[dict[str, Any]]]) -> tuple[str, list[float]]:
    """The Markdown table (medians over rounds and ranks) and each colocated ratio x N."""
    lines = ["| ranks | placement | optimizer state per rank, MB (min-max over ranks) | "
             "peak RSS per rank, MiB (median, min-max) |", "|---|---|---|---|"]
    checks = []
    for n in RANKS:
        for name in PLACEMENTS:
            recs = results[name, n]
            state = [r["state_bytes"] / 1e6 for r in recs]
            rss = [r["peak_rss_mb"] for r in recs]
            lines.append(f"| {n} | {name} | {statistics.median(state):.2f} ({min(state):.2f}-"
                         f"{max(state):.2f}) | {statistics.median(rss):.0f} ({min(rss):.0f}-"
                         f"{max(rss):.0f}) |")
        ring = statistics.median(r["state_bytes"] for r in results["ring", n])
        checks.append(max(r["state_bytes"] for r in results["colocated", n]) * n / ring)
    return "\n".join(lines), checks


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the jobs, prints the section and, unless ``--no-write``, writes it."""
    p = harness.parser("ps_memory.py", __doc__.splitlines()[0], SIZES)
    args = harness.parse(p, argv)
    machine = harness.machine_record()
    results = measure(args)
    grid, checks = table(results)
    params = results["ring", RANKS[0]][0]["params"]
    met = all(abs(c - 1) <= TOLERANCE for c in checks)
    ratios = ", ".join(f"N={n}: {c:.4f}" for n, c in zip(RANKS, checks, strict=True))
    worst = max(abs(c - 1) for c in checks)
    verdict = (f"{'met' if met else f'missed by {worst - TOLERANCE:.4f}'}: largest colocated "
               f"shard's state x N / ring's "
               f"state = {ratios}")
    notes = [f"Model: digits MLP 64-{args.hidden}-{args.hidden}-10 ({params / 1e6:.2f} M "
             f"parameters), Adam (two float32 moments and a step count a tensor), "
             f"{args.steps} steps of 8 samples a rank, {args.rounds} round(s), each setting a "
             "job of its own.",
             "Peak RSS counts the runtime (torch, Horovod, the data set), the parameters and their "
             "gradients, which stay whole on every rank, so it falls by less than the optimizer "
             "state does.",
             f"Result: {verdict}."]
    entry = harness.Entry(label="Optimizer memory, ring against colocated servers",
                          script="ps_memory.py",
                          target=f"colocated optimizer state per rank = ring's / N (within "
                                 f"{TOLERANCE:.0%})", verdict=verdict)
    harness.publish(harness.section_text(
        "Optimizer memory per rank, ring against colocated parameter servers", args.command,
        machine, ["Per rank, medians over ranks and rounds:\n\n" + grid], notes, entry=entry),
        args)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
        sys.exit(0)
    sys.exit(main())
