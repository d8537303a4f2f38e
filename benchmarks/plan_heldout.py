"""`hvdtrain plan` on a case its formulas were never adjusted on, predicted before it is measured.

plan_check.py judges the plan on the MLP and the two link rates (100 Mbit/s, 1 Gbit/s) that the
formulas were revised against, run after run; this script holds out both. The model is the built-in
GPT of ``configs/lm_torch.yaml``, widened (:data:`MODEL`: 4 blocks of width 256, 13.2 MB of float32
gradients, batch 4 sequences of 64 tokens) so that the link matters at the held-out rate, 300 Mbit/s
(:data:`RATE`). The nodes are ``scripts/cluster_local.sh``'s, one rank a node, as plan_check.py
runs them, and the plan is made as plan_check.py makes it: each worker count's link calibrated by
``hvdtrain plan calibrate`` over the job's nodes under each controller, the model profiled once on
one rank, each setting planned from the cluster file of the controller it runs under.

Two steps, run apart, with a commit between them (docs/planner.md, "Held-out check")::

    .venv/bin/python benchmarks/plan_heldout.py predict   # writes PREDICTION; commit it first
    .venv/bin/python benchmarks/plan_heldout.py measure   # trains each setting a few steps

``predict`` calibrates, profiles and plans, and writes :data:`PREDICTION` (the predicted steps,
the calibrated links, the profile's times). ``measure`` reads it, trains each setting for a few
steps (the median wall time between consecutive steps' records from step 3 on, as plan_check.py),
and prints each measured step beside its prediction: ratio measured / predicted, within 15% or
not. ``--unshaped`` runs each job again on unshaped links (is the link the bottleneck?). Needs
root (network namespaces); the cluster is stopped at the end, also on failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import harness
import plan_check
import ps_links

RATE = "300mbit"
"""The held-out link rate, between the two plan_check.py measures."""
WORKERS = (2, 4)
CONFIG = harness.ROOT / "configs" / "lm_torch.yaml"
MODEL = ["model.options.d_model=256", "model.options.layers=4", "model.options.heads=4",
         "data.batch_size=4", f"data.options.root={harness.ROOT / 'data' / 'docs-text'}",
         "train.threads=1"]
"""The GPT as held out: wider and deeper than the shipped config's (64 x 2) so that its gradients
(13.2 MB) make the link count at 300 Mbit/s; one compute thread a rank, as plan_check.py."""
PREDICTION = harness.ROOT / "benchmarks" / "plan_heldout_prediction.json"
TARGET = 0.15
CHECKS = [  # label, the plan's setting (S: servers = n), controller, server nodes?, overrides
    ("ring (Gloo)", "ring", "gloo", False, ()),
    ("ring fp16 (Gloo)", "ring fp16", "gloo", False, ("comm.compression=fp16",)),
    ("ring (MPI)", "ring", "mpi", False, ()),
    ("servers S=n (MPI)", "ps dedicated S={n}", "mpi", True, ()),
]
"""What is predicted and measured at each worker count."""


def _hvdtrain() -> str:
    return str(harness.python().parent / "hvdtrain")


def profile(work: Path) -> Path:
    """The held-out model's one-rank profile (``hvdtrain plan profile``)."""
    out = work / "profile.json"
    subprocess.run([_hvdtrain(), "plan", "profile", str(CONFIG), *MODEL, "--out", str(out)],
                   check=True, cwd=harness.ROOT, capture_output=True, text=True)
    return out


def planned(prof: Path, cluster: Path, n: int) -> dict[str, dict]:
    """Per setting of ``hvdtrain plan --json``: its point at n nodes and its exposed link time."""
    out = cluster.with_suffix(".json")
    subprocess.run([_hvdtrain(), "plan", str(CONFIG), *MODEL, "--cluster", str(cluster),
                    "--profile", str(prof), "--json", str(out)], check=True, cwd=harness.ROOT,
                   capture_output=True, text=True)
    found = {}
    for pred in json.loads(out.read_text())["settings"]:
        points = [p for p in pred.get("points", []) if p["nodes"] == n and p.get("step_s")]
        if points:
            link = sum(s["end_s"] - s["start_s"] for s in pred["timeline"] if s["lane"] == "comm")
            found[pred["setting"]] = {**points[0], "how": pred["how"], "link_s": link}
    return found


def head() -> str:
    """The commit the plan was made at (HEAD), with ``+changes`` where the tree differs."""
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=harness.ROOT,
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "hvdtrain"], cwd=harness.ROOT,
                           capture_output=True, text=True).stdout.strip()
    return sha + (" +changes to hvdtrain/" if dirty else "")


def uptime() -> str:
    """The machine's load, as ``uptime`` prints it (the machine is shared)."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def predict(args: argparse.Namespace) -> int:
    """Calibrates, profiles, plans; writes :data:`PREDICTION` and prints its table."""
    record: dict = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    "commit": head(), "rate": RATE, "config": str(CONFIG.relative_to(harness.ROOT)),
                    "model": MODEL[:4], "uptime_before": uptime(), "links": {}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="hvdtrain-plan-heldout-") as tmp:
        work = Path(tmp)
        try:
            ps_links.cluster("start", str(2 * max(WORKERS)), "--bandwidth", RATE)
            prof = profile(work)
            tree = json.loads(prof.read_text())
            record["profile"] = {k: tree[k] for k in ("batch_size", "forward_s", "backward_s",
                                                       "update_s")}
            record["profile"]["gradient_bytes"] = sum(t["bytes"] for t in tree["tensors"])
            for n in WORKERS:
                plans = {}
                for controller in ("gloo", "mpi"):
                    link = ps_links.calibrate(work, RATE, args.timeout, n, controller)
                    harness.log(f"{RATE}, {n} ranks, {controller}: {link}")
                    cluster = plan_check.cluster_file(work, RATE, n, link, controller)
                    record["links"][f"{n} {controller}"] = {**dataclasses.asdict(link),
                                                            "file": cluster.read_text()}
                    plans[controller] = planned(prof, cluster, n)
                for label, setting, controller, _, _ in CHECKS:
                    name = setting.format(n=n)
                    point = plans[controller][name]
                    record["rows"].append({
                        "n": n, "label": label, "setting": name, "controller": controller,
                        "predicted_s": point["step_s"], "link_s": point["link_s"],
                        "plan_link_bound": point["link_s"] >= 0.5 * point["step_s"]})
        finally:
            ps_links.cluster("stop")
    record["uptime_after"] = uptime()
    PREDICTION.write_text(json.dumps(record, indent=1) + "\n")
    print(prediction_table(record))
    print(f"wrote {PREDICTION.relative_to(harness.ROOT)}: commit it before `measure`")
    return 0


def prediction_table(record: dict) -> str:
    """The predictions as a Markdown table."""
    lines = ["| workers | setting | predicted step, s | planned link share |",
             "|---|---|---|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['n']} | {r['label']} | {r['predicted_s']:.3f} | "
                     f"{r['link_s'] / r['predicted_s']:.0%} |")
    return "\n".join(lines)


def step_time(n: int, servers: int, controller: str, extra: Sequence[str], steps: int,
              timeout: float) -> float:
    """One job of the held-out model on the started nodes (``servers`` server ranks after the
    ``n`` workers, one rank a node): the median wall time between consecutive steps' records from
    step 3 on, in seconds (as ``ps_links.step_time``)."""
    hosts = ",".join(f"node{i}:1" for i in range(1, n + servers + 1))
    topology = ["comm.topology=ps", f"ps.servers={servers}"] if servers else []
    env = {**os.environ, "PATH": f"{ps_links.CLUSTER_DIR / 'bin'}{os.pathsep}{os.environ['PATH']}",
           **(ps_links.MPI_RING if controller == "mpi" and not servers else {})}
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        argv = [harness.horovodrun(), "-np", str(n + servers), "-H", hosts, f"--{controller}",
                "--network-interfaces", ps_links.IFACE, _hvdtrain(), "train", str(CONFIG),
                f"log.dir={out}", "log.wandb=disabled", "log.console=false", "log.every_steps=1",
                f"train.max_steps={steps}", "optim.warmup_steps=0", "checkpoint.enabled=false",
                "checkpoint.every_steps=0", *MODEL, *topology, *extra]
        proc = subprocess.run(argv, env=env, cwd=harness.ROOT, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise harness.BenchError(f"n={n} servers={servers} {controller}: exit "
                                     f"{proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    by_step = {r["step"]: r for r in records if "step_time_s" in r and "eval_loss" not in r}
    kept = [r for s, r in by_step.items() if s > 2 and s - 1 in by_step]
    if not kept:
        raise harness.BenchError(f"n={n}: no step times after step 2 (raise --steps)")
    return statistics.median(r["time_s"] - by_step[r["step"] - 1]["time_s"] for r in kept)


def run_all(record: dict, args: argparse.Namespace, bandwidth: str, key: str) -> None:
    """Every predicted row not yet measured trained once on links of ``bandwidth``; its step
    under ``key``, the record written to ``--out`` after each row."""
    ps_links.cluster("start", str(2 * max(WORKERS)), "--bandwidth", bandwidth)
    for row in record["rows"]:
        if key in row:  # measured by the run that --resume goes on from
            continue
        check = next(c for c in CHECKS if c[0] == row["label"])
        servers = row["n"] if check[3] else 0
        row[key] = step_time(row["n"], servers, row["controller"], check[4], args.steps,
                             args.timeout)
        harness.log(f"{bandwidth} n={row['n']} {row['label']}: {row[key]:.3f} s a step, "
                    f"predicted {row['predicted_s']:.3f}")
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


def measure(args: argparse.Namespace) -> int:
    """Trains every predicted row; prints measured beside predicted (the prediction unchanged)."""
    record = json.loads(PREDICTION.read_text())
    if args.resume:  # an interrupted measurement: its rows are kept, not measured again
        record = json.loads(Path(args.out).read_text())
        assert [r["predicted_s"] for r in record["rows"]] == [
            r["predicted_s"] for r in json.loads(PREDICTION.read_text())["rows"]]
    record.setdefault("measured", {}).setdefault("runs", []).append({
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "uptime_before": uptime(), "steps": args.steps})
    try:
        run_all(record, args, RATE, "measured_s")
        record["measured"]["runs"][-1]["uptime_shaped"] = uptime()
        if args.unshaped:
            run_all(record, args, "none", "unshaped_s")
    finally:
        ps_links.cluster("stop")
    record["measured"]["runs"][-1]["uptime_after"] = uptime()
    print(measured_table(record))
    out = Path(args.out)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def measured_table(record: dict) -> str:
    """Predicted, measured and their ratio per row, with the verdict against :data:`TARGET`."""
    lines = ["| workers | setting | predicted step, s | measured step, s | measured / predicted "
             "| within 15% | unshaped step, s |", "|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        ratio = r["measured_s"] / r["predicted_s"]
        bare = f"{r['unshaped_s']:.3f}" if "unshaped_s" in r else "not run"
        lines.append(f"| {r['n']} | {r['label']} | {r['predicted_s']:.3f} | "
                     f"{r['measured_s']:.3f} | {ratio:.2f} | "
                     f"{'yes' if abs(ratio - 1) <= TARGET else 'no'} | {bare} |")
    hits = sum(abs(r["measured_s"] / r["predicted_s"] - 1) <= TARGET for r in record["rows"])
    return "\n".join(lines) + f"\n\n{hits} of {len(record['rows'])} within 15%"


def main(argv: Sequence[str] | None = None) -> int:
    """``predict`` or ``measure`` (see the module's docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=("predict", "measure"))
    p.add_argument("--steps", type=int, default=6, help="steps a job trains (3 and on timed)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a job may take")
    p.add_argument("--unshaped", action="store_true", help="measure: each job on unshaped links too")
    p.add_argument("--out", default="/tmp/plan_heldout_measured.json",
                   help="measure: where the measured record goes")
    p.add_argument("--resume", action="store_true",
                   help="measure: go on from --out, measuring only the rows it lacks")
    args = p.parse_args(argv)
    return predict(args) if args.step == "predict" else measure(args)


if __name__ == "__main__":
    sys.exit(main())
