"""Benchmark: what an elastic commit costs with sharded data parallel, against the ring's.

The ring commits its state into memory (``torch.save`` of the model and optimizer into bytes); a
sharded run (``shard.stage`` 1-3) also writes every rank's shards to disk at each commit (each
rank its own part, atomically, with fsync: docs/sharding.md, "Elastic mode"), since a rank's
shards die with it. Each job is a 2-worker elastic run (hosts ``localhost`` and ``127.0.0.1``)
of the digits MLP 64-2048-2048-10 (4.3 M parameters) with Adam, committing every few steps,
with no worker lost; the figure is rank 0's ``elastic.commit_s`` over its commits (the start's
included), and the step time beside it. The settings run interleaved, one job each a round, the
ring again last as an A/A control. No target: the figure is what the docs say a commit costs.

Usage (from the repository root, under ``flock /work/brief/measure.lock``)::

    .venv/bin/python benchmarks/shard_elastic_commit.py
    .venv/bin/python benchmarks/shard_elastic_commit.py --quick --no-write
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import harness

ROOT = harness.ROOT
BIN = harness.python().parent
SIZES = {"rounds": (2, 1), "steps": (40, 10)}
COMMIT_EVERY = 5
SETTINGS = {"ring": "shard.stage=0", "stage 1": "shard.stage=1", "stage 3": "shard.stage=3",
            "ring (A/A control)": "shard.stage=0"}


def job(setting: str, run: Path, steps: int, timeout: float) -> dict:
    """One elastic job; returns rank 0's seconds a commit and the median step time."""
    cmd = [str(BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", str(ROOT / "scripts" / "discover_hosts_static.sh"),
           str(BIN / "hvdtrain"), "train", "configs/digits_torch.yaml", "elastic.enabled=true",
           f"elastic.commit_every={COMMIT_EVERY}", "model.options={hidden: [2048, 2048]}",
           "optim.name=adam", "optim.lr=0.001", f"train.max_steps={steps}",
           "checkpoint.every_steps=0", "log.every_steps=1", "log.console=false",
           "log.wandb=disabled", f"log.dir={run}", SETTINGS[setting]]
    with (run.parent / f"{run.name}.log").open("w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env=harness.worker_env(), stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout).returncode
    if code != 0:
        raise harness.BenchError(f"{setting}: exit {code}; see {run.parent / (run.name + '.log')}")
    summary = json.loads((run / "summary.json").read_text())
    elastic = summary["elastic"]
    times = sorted(r["step_time_s"] for r in map(json.loads, (run / "metrics.jsonl").read_text()
                                                 .splitlines()) if "step_time_s" in r)
    return {"setting": setting, "commit_s": elastic["commit_s"] / (elastic["commits"] + 1),
            "commits": elastic["commits"] + 1, "step_s": times[len(times) // 2]}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the jobs, prints the section and, unless ``--no-write``, writes it."""
    p = harness.parser("shard_elastic_commit.py", __doc__.splitlines()[0], SIZES, timeout=600.0)
    args = harness.parse(p, argv)
    machine = harness.machine_record()
    records = []
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-shard-elastic-") as tmp:
        for index in range(args.rounds):
            for setting in harness.round_order(list(SETTINGS), index):
                run = Path(tmp) / f"s{list(SETTINGS).index(setting)}-{index}"
                records.append(job(setting, run, args.steps, args.timeout))
                print(json.dumps(records[-1]), flush=True)
    samples = {s: [r["commit_s"] for r in records if r["setting"] == s] for s in SETTINGS}
    steps = {s: [r["step_s"] for r in records if r["setting"] == s] for s in SETTINGS}
    rows = harness.summarize(samples, "ring")
    by = harness.by_name(rows)
    worst = max(by["stage 1"].median, by["stage 3"].median)
    step = min(sorted(v)[len(v) // 2] for v in steps.values())
    notes = [
        "Per job: 2 workers (hosts `localhost` and `127.0.0.1`), Gloo, the digits MLP "
        f"64-2048-2048-10 with Adam, `elastic.commit_every={COMMIT_EVERY}`, "
        f"{args.steps} steps, no worker lost.",
        "Figure: rank 0's `elastic.commit_s` over its commits (the start's included). The ring "
        "serialises the whole model and optimizer into memory; stages 1-3 write each rank's "
        "shards of the parameters and Adam's moments (12/N bytes a parameter) to its own part "
        "and fsync it, then rank 0 serialises the rest.",
        "Step time (median of rank 0's records): " + "; ".join(
            f"{s} {sorted(v)[len(v) // 2]:.3f} s" for s, v in steps.items()) + ".",
    ]
    entry = harness.Entry(
        label="Elastic commit with sharding", script="shard_elastic_commit.py",
        target="none (a cost the docs state)",
        verdict=f"no target: a sharded commit {worst:.3f} s at most (median), "
                f"{worst / step:.2f} x the fastest median step")
    harness.publish(harness.section_text(
        "Elastic commit with sharded data parallel (seconds a commit)", args.command, machine,
        [harness.table_block("Seconds a commit, rank 0 (ratio: to the ring).", rows, unit="s",
                             scale=1.0, digits=3)], notes, entry=entry), args)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.TimeoutExpired as exc:
        sys.exit(f"timed out: {exc}")
