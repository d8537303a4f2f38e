"""Gradient compression benchmark: accuracy, bytes and time of every method, per framework and dataset,
plus time to a target accuracy over an emulated 100 Mbit/s link.

Usage (from the repository root; the slow-link part needs root for the network namespace):

    .venv/bin/python scripts/bench/compression.py --seeds 5 --frameworks torch,tensorflow
    .venv/bin/python scripts/bench/compression.py --seeds 2 --no-slow-link      # accuracy table only

For each framework, dataset and seed one ``horovodrun -np 2 --gloo`` job trains every method back to
back (the order rotates with the seed, so no method always runs in the same slot of a busy machine);
rank 0 prints one JSON line per run, which the driver collects. The slow-link job runs inside a
network namespace whose loopback is shaped by ``tc tbf rate 100mbit`` (set up and torn down here),
with a wide MLP so that the gradient exchange dominates the step. The table is written into
``docs/benchmarks.md`` with the command that made it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402
import launch  # noqa: E402

METHODS = {
    "none": ["comm.compression=none"],
    "fp16": ["comm.compression=fp16"],
    "topk": ["comm.compression=topk"],
    "topk-noEF": ["comm.compression=topk", "comm.error_feedback=false"],
    "randomk": ["comm.compression=randomk"],
    "qsgd": ["comm.compression=qsgd"],
    "powersgd": ["comm.compression=powersgd"],
}
"""Benchmarked variants: each method with its defaults; top-k without error feedback as the control."""

DATASETS = {
    "digits": [],
    "mnist1d": ["data.name=mnist1d", "model.options.hidden=[256,256]", "train.epochs=6"],
}
"""Overrides of the framework's digits config per dataset."""

SLOW = ["model.options.hidden=[1024,1024]", "train.epochs=5", "optim.warmup_steps=0",
        "optim.schedule=constant", "checkpoint.enabled=false"]
"""The slow-link workload: a 1.1M-parameter MLP on digits, whose 4.4 MB of gradients take about
0.35 s per step at 100 Mbit/s, against milliseconds of computation."""

NETNS = "hvdtrain-bench"
"""Default name of the slow link's network namespace (``--netns``)."""
KEY = "bench_compression"


# worker side: runs under horovodrun -------------------------------------------------------------

def time_to(metrics: Path, target: float) -> float | None:
    """Seconds from the start of training to the first evaluation at or above ``target``."""
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("eval_accuracy", -1.0) >= target:
            return float(record["time_s"])
    return None


def worker(args: argparse.Namespace) -> None:
    """Trains every method in turn on this rank; rank 0 prints one JSON line per run."""
    from hvdtrain.config import load_config
    from hvdtrain.trainer import train

    methods = args.methods.split(",")
    shift = args.seed % len(methods)
    for method in methods[shift:] + methods[:shift]:
        run_dir = Path(args.out) / f"{args.dataset}-{method}-s{args.seed}"
        cfg = load_config(ROOT / "configs" / f"digits_{'tf' if args.framework == 'tensorflow' else 'torch'}.yaml",
                          ["log.console=false", "log.wandb=disabled", "log.tensorboard=false",
                           "log.overwrite=true", f"log.dir={run_dir}", f"seed={args.seed}",
                           *DATASETS.get(args.dataset, []), *METHODS[method], *args.extra])
        result = train(cfg)
        if result.engine.rank == 0:
            print(json.dumps(measure(result, method, args, run_dir)), flush=True)


def measure(result: Any, method: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """One run's record from its summary, metrics and the engine's exchange."""
    s = result.summary
    steps, ranks = s["steps"], s["world_size"]
    exchange = getattr(result.engine, "exchange", None)
    compress = getattr(exchange, "compress_s_total", None) if exchange is not None else None
    return {KEY: 1, "framework": args.framework, "dataset": args.dataset, "method": method,
            "seed": args.seed, "accuracy": s["final"]["eval_accuracy"],
            "wire_per_step": s["wire_bytes_total"] / steps / ranks,
            "ratio": s["dense_bytes_total"] / s["wire_bytes_total"],
            "compress_ms": None if compress is None else 1e3 * compress / steps,
            "step_ms": 1e3 * s["train_time_s"] / steps,
            "to_target_s": time_to(run_dir / "metrics.jsonl", args.target) if args.target else None}


# driver side ------------------------------------------------------------------------------------

def job(framework: str, dataset: str, seed: int, methods: Sequence[str], out: Path,
        extra: Sequence[str] = (), target: float = 0.0, netns: str | None = None) -> list[dict]:
    """Runs one worker job and returns its records."""
    argv = [launch.horovodrun(), "-np", "2", "--gloo", str(launch.python()), str(Path(__file__)),
            "--worker", "--framework", framework, "--dataset", dataset, "--seed", str(seed),
            "--methods", ",".join(methods), "--out", str(out), "--target", str(target),
            *[f"--extra={e}" for e in extra]]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    print(f"[bench] {framework} {dataset} seed {seed}: {','.join(methods)}", file=sys.stderr, flush=True)
    proc = subprocess.run(argv, env=launch.worker_env(), capture_output=True, text=True, timeout=7200)
    records = harness.parse_measurements(proc.stdout, KEY)
    if proc.returncode != 0 or len(records) != len(methods):
        raise harness.BenchError(f"job failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return records


class SlowLink:
    """A network namespace whose loopback is a 100 Mbit/s link; removed on exit."""

    def __init__(self, name: str = NETNS) -> None:
        self.name = name

    def __enter__(self) -> str:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)  # a crash's leftover
        for cmd in (["ip", "netns", "add", self.name],
                    ["ip", "-n", self.name, "link", "set", "lo", "up"],
                    ["ip", "netns", "exec", self.name, "tc", "qdisc", "add", "dev", "lo", "root",
                     "tbf", "rate", "100mbit", "burst", "256kb", "latency", "50ms"]):
            subprocess.run(cmd, check=True)
        return self.name

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "netns", "del", self.name], check=False)


def fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def accuracy_table(records: list[dict], methods: Sequence[str]) -> str:
    """One row per framework, dataset and method: medians and spread over seeds."""
    cells = []
    for fw in dict.fromkeys(r["framework"] for r in records):
        for ds in dict.fromkeys(r["dataset"] for r in records):
            for m in methods:
                rs = [r for r in records if (r["framework"], r["dataset"], r["method"]) == (fw, ds, m)]
                if not rs:
                    continue
                acc = [r["accuracy"] for r in rs]
                comp = [r["compress_ms"] for r in rs if r["compress_ms"] is not None]
                cells.append([f"{fw} {ds} {m}", str(len(rs)), f"{statistics.mean(acc):.4f}",
                              f"{min(acc):.4f}–{max(acc):.4f}",
                              f"{statistics.median(r['wire_per_step'] for r in rs):,.0f}",
                              f"{statistics.median(r['ratio'] for r in rs):.1f}",
                              fmt(statistics.median(comp) if comp else None, 2),
                              f"{statistics.median(r['step_ms'] for r in rs):.1f}"])
    return harness.markdown_grid(["framework dataset method", "seeds", "accuracy mean",
                                  "accuracy min–max", "wire bytes/step/rank", "ratio",
                                  "compression ms/step", "step ms"], cells)


def none_time(records: list[dict], framework: str) -> float | None:
    """``none``'s time to the target in ``framework``'s slow-link run: the baseline of its rows."""
    return next((r["to_target_s"] for r in records
                 if (r["framework"], r["method"]) == (framework, "none")), None)


def slow_table(records: list[dict], target: float) -> str:
    """Time to the target accuracy per method, and how much sooner than the same framework's
    ``none``."""
    cells = []
    for r in records:
        base = none_time(records, r["framework"])
        cells.append([f"{r['framework']} {r['method']}", fmt(r["to_target_s"]),
                      fmt(base / r["to_target_s"] if base and r["to_target_s"] else None, 2),
                      f"{r['step_ms']:.0f}", f"{r['ratio']:.1f}", f"{r['accuracy']:.4f}"])
    return harness.markdown_grid(["framework method", f"time to {target} s", "sooner than none (x)",
                                  "step ms", "ratio", "final accuracy"], cells)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frameworks", default="torch", help="comma-separated: torch,tensorflow")
    p.add_argument("--datasets", default="digits,mnist1d")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--slow-link", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--slow-target", type=float, default=0.93)
    p.add_argument("--slow-extra", action="append", default=[],
                   help="config override added to the slow-link workload (repeatable)")
    p.add_argument("--netns", default=NETNS, help="name of the slow link's network namespace")
    p.add_argument("--out", default="/tmp/hvdtrain-bench-compression")
    p.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--train-extra", action="append", default=[],
                   help="config override added to the accuracy runs (repeatable)")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    p.add_argument("--quick", action="store_true",
                   help="tiny end-to-end check: 1 seed, digits, none/topk/powersgd, 1 epoch, "
                        "no slow link, nothing written")
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--framework", default="torch", help=argparse.SUPPRESS)
    p.add_argument("--dataset", default="digits", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--target", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--extra", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.datasets, args.methods = 1, "digits", "none,topk,powersgd"
        args.slow_link, args.no_write = False, True
        args.train_extra = [*args.train_extra, "train.epochs=1"]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    methods, out = args.methods.split(","), Path(args.out)
    slow: list[dict] = []
    if args.slow_link:  # first: it is the shortest part and the headline figure
        with SlowLink(args.netns) as netns:
            for fw in args.frameworks.split(","):
                slow += job(fw, "digits", 0, [m for m in methods if m != "topk-noEF"], out / "slow" / fw,
                            [*SLOW, *args.slow_extra], args.slow_target, netns)
        print(slow_table(slow, args.slow_target), flush=True)
    records = [r for fw in args.frameworks.split(",") for ds in args.datasets.split(",")
               for seed in range(args.seeds)
               for r in job(fw, ds, seed, methods, out / fw, args.train_extra)]
    blocks = []
    if records:
        blocks.append("Accuracy, bytes and time per method (2 ranks, Gloo, one job per framework, "
                      "dataset and seed; bytes are what each rank hands to Horovod per step):\n\n"
                      + accuracy_table(records, methods))
    if slow:
        blocks.append("Over an emulated 100 Mbit/s link (`tc tbf` on a network namespace's loopback), "
                      "MLP 64-1024-1024-10 on digits, seed 0"
                      + "".join(f", {e}" for e in args.slow_extra) + ":\n\n"
                      + slow_table(slow, args.slow_target))
    command = f"{launch.reproduce_interpreter()} scripts/bench/compression.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    title = f"Gradient compression: {args.seeds} seed{'s' if args.seeds != 1 else ''}, {args.frameworks}"
    section = harness.section_text(title, command, harness.machine_record(),
                                   blocks, notes(records, slow))
    if not args.no_write:
        harness.put_section(Path(args.markdown), section, "# Benchmarks")
    print(section)
    return 0


def notes(records: list[dict], slow: list[dict]) -> list[str]:
    """What the columns mean, and the verdicts."""
    out = ["Methods use the config defaults: `comm.ratio` 0.01, `comm.rank` 2, `comm.bucket` 512, "
           "`comm.min_size` 1024 (smaller tensors, such as biases, travel uncompressed, which caps "
           "the small MLPs' overall ratio well below the 50x or 100x of the compressed tensors).",
           "Compression ms/step: hvdtrain's exchange less its waits for Horovod (kernels, "
           "scatter, decode); — for PyTorch's `none` and `fp16`, whose cast runs inside Horovod's "
           "hooks (TensorFlow runs every method through its exchange: for `fp16`, the two casts).",
           "Step ms: training time / steps (includes the exchange and its waits)."]
    out += accuracy_verdicts(records)
    for fw in dict.fromkeys(r["framework"] for r in slow):
        finite = [r for r in slow if r["framework"] == fw and r["method"] != "none"
                  and r["to_target_s"]]
        base = none_time(slow, fw)
        if finite and base:
            best = min(finite, key=lambda r: r["to_target_s"])
            out.append(f"Slow link, {fw}: best method {best['method']} reaches the target "
                       f"{base / best['to_target_s']:.1f}x sooner than none (target: >= 3x).")
    return out


BARS = {"fp16": 0.005, "qsgd": 0.005, "topk": 0.01, "powersgd": 0.01}
"""The issue's accuracy bars on digits: largest drop below ``none``'s mean accuracy."""


def accuracy_verdicts(records: list[dict]) -> list[str]:
    """Per framework on digits: each barred method's mean accuracy against ``none``'s."""
    out = []
    for fw in dict.fromkeys(r["framework"] for r in records):
        def mean(method: str) -> float | None:
            acc = [r["accuracy"] for r in records
                   if (r["framework"], r["dataset"], r["method"]) == (fw, "digits", method)]
            return statistics.mean(acc) if acc else None
        base = mean("none")
        parts = [f"{m} {100 * (mean(m) - base):+.2f} points "
                 f"({'met' if base - mean(m) <= bar + 1e-9 else 'missed'}, bar -{100 * bar:g})"
                 for m, bar in BARS.items() if base is not None and mean(m) is not None]
        if parts:
            out.append(f"Accuracy bars, {fw} digits, mean over seeds against none: "
                       + "; ".join(parts) + ".")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
