"""Two nodes on shaped links against one host: allreduce bus bandwidth, hvdtrain samples/s, and time
to accuracy per compression method.

The nodes are the network-namespace nodes of ``scripts/cluster_local.sh`` (started here when
down and stopped again at the end; needs root); each link's rate is set between jobs with
``cluster_local.sh start 2 --bandwidth RATE`` (``tc tbf`` on each node's side: rate only, no added
latency). One part a run, each its own section:

- ``bandwidth``: one ``horovodrun -np 2 --gloo`` job per placement (one host; two nodes unshaped,
  the CPU's ceiling across nodes; two nodes at each rate) of ``allreduce_worker``'s measurement:
  raw ``torch.distributed`` Gloo (A), Horovod (B), raw again (A', the A/A control) and a memory
  copy, interleaved in rounds. Target: Horovod's bus bandwidth >= 0.9 x the link rate at 64 MB and
  up, where the link, not the CPU, is the limit.
- ``training``: hvdtrain's steady-state samples/s on a wide MLP whose gradients (4.5 MB a step)
  load the link, one job a placement, the placements interleaved in rounds with one host twice
  (A and A', the A/A control). No target: what a link costs.
- ``compression``: ``compression.py``'s worker (every method in turn, the order rotating with the
  seed) over the 1 Gbit/s and 100 Mbit/s links between the nodes, one job per seed and rate, the
  rates alternating. Target: the best method reaches 0.93 test accuracy >= 3x sooner than ``none``
  at 100 Mbit/s.

Usage (from the repository root; each part fits 15 minutes on 2 cores)::

    .venv/bin/python benchmarks/cluster.py --part bandwidth
    .venv/bin/python benchmarks/cluster.py --part training
    .venv/bin/python benchmarks/cluster.py --part compression
    .venv/bin/python benchmarks/cluster.py --part bandwidth --quick --no-write   # a tiny check
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import harness

CLUSTER = harness.ROOT / "scripts" / "cluster_local.sh"
CLUSTER_DIR = Path(os.environ.get("HVDTRAIN_CLUSTER_DIR", "/run/hvdtrain-cluster"))
NODES = ["-H", "node1:1,node2:1", "--network-interfaces", "br-hvd"]
IFACE = "br-hvd"
RATES = {"10gbit": 10e9, "1gbit": 1e9, "100mbit": 100e6}
"""The shaped links, in bits per second."""
LINK_TARGET, LINK_FROM = 0.9, 64 << 20
SPEEDUP_TARGET = 3.0
ONE_THREAD = "train.threads=1"
"""Every node of this cluster sees the machine's cores, so ``train.threads: 0`` would give each of
the two ranks all of them (one host gives each rank its share): one thread a rank everywhere."""
WIDE = ["model.options.hidden=[1024,1024]", ONE_THREAD]
"""The training part's MLP, 64-1024-1024-10 as in ``compression.SLOW``."""
GRADIENT_BYTES = 4 * (64 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10)
SIZES = {"rounds": (3, 1), "warmup": (1, 0), "seeds": (3, 1), "epochs": (3, 2)}


# Worker side -------------------------------------------------------------------------------------

def allreduce_job(argv: Sequence[str]) -> int:
    """``allreduce_worker``'s measurement with raw Gloo's rendezvous at rank 0's own address (the
    worker's loopback rendezvous cannot reach across nodes)."""
    import torch

    import allreduce_worker as aw

    args = aw.parse_args(argv)
    aw.hvd.init()
    torch.set_num_threads(1)
    if aw.CONTROLLER == "gloo":
        host = socket.gethostbyname(os.environ.get("HOROVOD_HOSTNAME", "localhost"))
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        host, port = aw.hvd.broadcast_object((host, port) if aw.hvd.rank() == 0 else None,
                                             root_rank=0, name="bench.rendezvous")
        aw.dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}",
                                   rank=aw.hvd.rank(), world_size=aw.hvd.size())
    for size in args.sizes:
        aw.measure_size(aw.CONTROLLER, size, args.rounds, args.warmup, args.budget, args.max_iters)
    return 0


def wide(epochs: int, out_dir: Path) -> dict[str, Any]:
    """``hvdtrain_worker.run`` on the wide MLP: one run's record on this rank."""
    import hvdtrain_worker as hw
    import workload
    from hvdtrain.config import load_config

    cfg = load_config(hw.CONFIGS["torch"], [*hw.overrides("torch", epochs, out_dir), *WIDE],
                      environ={})
    result, clock = hw.train_clocked(cfg)
    s = result.summary
    return workload.measurement(result.engine.rank, s["steps"], s["samples"], s["wall_time_s"],
                                s["final"].get("eval_accuracy"), clock, epochs)


VARIANTS = {"wide": wide}
"""Run functions for ``workload.job_main`` (``cluster:wide``)."""


# The cluster -------------------------------------------------------------------------------------

def cluster(*args: str) -> subprocess.CompletedProcess:
    """``scripts/cluster_local.sh ARGS``, output kept."""
    return subprocess.run(["bash", str(CLUSTER), *args], capture_output=True, text=True)


def shape(rate: str) -> None:
    """Sets every node's link to ``rate`` (``none``: unshaped)."""
    proc = cluster("start", "2", "--bandwidth", rate)
    if proc.returncode != 0:
        raise harness.BenchError(f"cluster_local.sh start --bandwidth {rate}:\n{proc.stderr}")


@contextmanager
def two_nodes() -> Iterator[None]:
    """The two nodes, started if down (and then stopped at the end), links unshaped at the end."""
    was_up = cluster("status").returncode == 0
    try:
        shape("none")
        yield
    finally:
        if was_up:
            shape("none")
        else:
            cluster("stop")


def launcher(placement: str, controller: str = "gloo") -> list[str]:
    """``horovodrun -np 2`` on one host, or one rank per node for any other placement."""
    hosts = [] if placement == "one host" else NODES
    return [harness.horovodrun(), "-np", "2", *hosts, f"--{controller}"]


def node_env() -> dict[str, str]:
    """The cluster's ssh wrapper first on PATH; Gloo on the nodes' interface."""
    return {"PATH": f"{CLUSTER_DIR / 'bin'}{os.pathsep}{os.environ['PATH']}",
            "GLOO_SOCKET_IFNAME": IFACE}


def run_on(placement: str, argv: Sequence[str], key: str, timeout: float,
           controller: str = "gloo") -> list[dict[str, Any]]:
    """Shapes the links for ``placement`` (a rate, ``unshaped`` or ``one host``) and runs the
    worker ``argv`` there; the records holding ``key``."""
    if placement != "one host":
        shape("none" if placement == "unshaped" else placement)
    env = {} if placement == "one host" else node_env()
    harness.log(f"{placement}: {Path(argv[1]).name} {' '.join(argv[2:4])}")
    return harness.run_job([*launcher(placement, controller), *argv], key, timeout, env)


def rate_of(placement: str) -> float | None:
    """The link rate in bytes/s, ``None`` where there is no shaped link."""
    return RATES[placement] / 8 if placement in RATES else None


# Part 1: allreduce bandwidth ---------------------------------------------------------------------

BW_SIZES = {"one host": "16M,64M,256M", "unshaped": "16M,64M,256M", "10gbit": "16M,64M,256M",
            "1gbit": "16M,64M,256M", "100mbit": "16M,64M"}
"""Sizes per placement: 256 MB would take 21 s an operation at 100 Mbit/s."""
SLOW_SIZES_NOTE = ("100mbit: 16 MB and 64 MB only (`BW_SIZES`): one 256 MB allreduce takes about "
                   "21 s at 100 Mbit/s, so a round of raw, Horovod and raw again would take over a "
                   "minute, and the rounds with their warm-up about 5 of the 15 minutes the part "
                   "is to fit in; the target is judged at 64 MB there.")


def sizes(text: str) -> str:
    """``16M,64M`` as bytes."""
    return ",".join(str(int(part[:-1]) << 20 if part.endswith("M") else int(part))
                    for part in text.split(","))


def bandwidth(args: argparse.Namespace) -> tuple[list[str], list[str], str]:
    """Runs one allreduce job per placement; the section's blocks, notes and verdict."""
    import allreduce_records as ar

    tables: dict[str, ar.Tables] = {}
    for placement in args.placements:
        argv = [str(harness.python()), str(harness.HERE / "cluster.py"), "--allreduce-worker",
                "--sizes", sizes(args.sizes or BW_SIZES[placement]), "--rounds", str(args.rounds),
                "--warmup", str(args.warmup), "--budget", str(64 << 20), "--max-iters", "8"]
        tables[placement] = ar.by_size(run_on(placement, argv, ar.KEY, args.timeout), args.rounds)
    header = ["placement", "size", "raw busbw median (min-max) Gbit/s",
              "Horovod busbw median (min-max) Gbit/s", "Horovod / link rate", "Horovod / raw",
              "A/A control", "limit"]
    cells, verdicts, briefs = [], [], []
    for placement, by in tables.items():
        for size, rows in by.items():
            cell, verdict = bandwidth_row(placement, size, rows, tables)
            cells.append(cell)
            if verdict:
                verdicts.append(f"{placement} {ar.human(size)}: {verdict}")
                shown = harness.brief(verdict) if isinstance(verdict, harness.Verdict) else verdict
                briefs.append(f"{placement} {ar.human(size)} {shown}")
    block = ("Bus bandwidth (nccl-tests: algbw x 2(n-1)/n, here x 1), 2 ranks over Gloo; raw = "
             "torch.distributed Gloo, A/A control = raw's second copy over its first:\n\n"
             + harness.markdown_grid(header, cells))
    notes = [f"Per size: {args.rounds} rounds after {args.warmup} warm-up of raw, Horovod, raw "
             "again and a memory copy (order reversed on odd rounds; `allreduce_worker.py`), about "
             "64 MB of back-to-back in-place float32 sums a run (1 to 8 operations), timed on "
             "rank 0.",
             "Limit: `link` where the two nodes unshaped moved at least twice the link rate (the "
             "CPU leaves the link the bottleneck), `CPU` where they moved less than the link rate, "
             "`both` between; the target is judged on `link` rows only. A link's rate counts "
             "Ethernet, IP and TCP headers: at MTU 1500 payload is at most 0.95 of it.",
             *[f"Result, {v}." for v in verdicts]]
    if "100mbit" in args.placements and not args.sizes:
        notes.insert(2, SLOW_SIZES_NOTE)
    return [block], notes, "; ".join(briefs) or "no size judged (no link-limited placement)"


def bandwidth_row(placement: str, size: int, rows: list[harness.Row],
                  tables: dict[str, Any]) -> tuple[list[str], harness.Verdict | str | None]:
    """One placement's size: the cells and, on a row from 64 MB where the link limits, the verdict
    (only shown where the CPU limits too)."""
    import allreduce_records as ar

    raw, hvd, control = rows[ar.RAW], rows[ar.HOROVOD], rows[ar.CONTROL]
    gbit = lambda v: 8 * ar.bus(v, 2)  # noqa: E731  GB/s of algbw -> Gbit/s of busbw
    rate = rate_of(placement)
    limit, verdict, share = "", None, "—"
    if rate:
        ceiling = tables.get("unshaped", {}).get(size)
        free = ar.bus(ceiling[ar.HOROVOD].median, 2) * 1e9 if ceiling else None
        limit = ("?" if free is None else "link" if free >= 2 * rate
                 else "CPU" if free < rate else "both")
        ratio = ar.bus(hvd.median, 2) * 1e9 / rate
        share = f"{ratio:.3f}"
        if limit in ("link", "both") and size >= LINK_FROM:
            verdict = harness.judge(ratio, control.ratio, LINK_TARGET, higher_is_better=True)
            if limit == "both":  # shown, not judged: the CPU is a limit too
                verdict = f"{ratio:.3f}, A/A control {control.ratio:.3f}: not judged (CPU and link)"
    spread = lambda r: f"{gbit(r.median):.3g} ({gbit(r.min):.3g}-{gbit(r.max):.3g})"  # noqa: E731
    return [placement, ar.human(size), spread(raw), spread(hvd), share, f"{hvd.ratio:.3f}",
            f"{control.ratio:.3f}", limit], verdict


# Part 2: hvdtrain samples/s ----------------------------------------------------------------------

def training(args: argparse.Namespace) -> tuple[list[str], list[str], str]:
    """Interleaves one job per placement in rounds, one host first and last; blocks, notes and
    the verdict (what each shaped link allowed)."""
    placements = ["one host", *[p for p in args.placements if p != "one host"], "one host "]
    records = []
    for round_index in range(args.rounds):
        for slot, placement in harness.round_order(list(enumerate(placements)), round_index):
            with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
                argv = [str(harness.python()), str(harness.HERE / "workload.py"), "--variants",
                        "cluster:wide", "--rounds", "1", "--warmup", str(args.warmup), "--epochs",
                        str(args.epochs), "--out-dir", out]
                found = [r for r in run_on(placement.strip(), argv, "samples_per_s", args.timeout)
                         if r["round"] >= 0]
            records += [{**r, "round": round_index, "slot": slot} for r in found]
    names = ["one host (A)", *placements[1:-1], "one host (A', A/A control)"]
    results = harness.group_runs(records, names, args.rounds)
    rows = harness.summarize(harness.samples_of(results, "steady_samples_per_s"), names[0])
    block = harness.table_block(
        "Steady-state samples/s (epochs 2 to N), 2 ranks over Gloo, MLP 64-1024-1024-10 on digits:",
        rows, unit="samples/s", scale=1.0, digits=1)
    named = harness.by_name(rows)
    ceilings = [f"{p} {2 * 32 / (GRADIENT_BYTES / rate_of(p)):,.0f}" for p in placements
                if rate_of(p)]
    notes = [f"One compute thread a rank everywhere (`{ONE_THREAD}`): each namespace node sees "
             "both cores, and `train.threads: 0` would give each rank two threads on the 2 cores "
             "the ranks share.",
             f"A run: {args.epochs} epochs of {next(iter(results.values()))[0]['steps']} steps, "
             f"batch 32 per rank, after {args.warmup} warm-up run in the same job; one job per "
             f"placement and round, {args.rounds} rounds, order reversed on odd rounds.",
             f"The link alone allows at most 64 samples per {GRADIENT_BYTES / 1e6:.2f} MB of "
             f"gradients through it (ring allreduce, 2 ranks): {', '.join(ceilings)} samples/s.",
             f"A/A control (one host again / one host): {named[names[-1]].ratio:.3f}; a "
             "difference within that is noise."]
    shares = [f"{p}: {named[p].median:,.0f} samples/s, "
              f"{named[p].median / (2 * 32 / (GRADIENT_BYTES / rate_of(p))):.2f} of the link's "
              "ceiling" for p in placements[1:-1] if rate_of(p)]
    verdict = "; ".join([*shares, f"against one host A/A control {named[names[-1]].ratio:.3f}"])
    return [block], notes, verdict


# Part 3: time to accuracy per compression method -------------------------------------------------

def compression(args: argparse.Namespace) -> tuple[list[str], list[str], str]:
    """One job per seed and rate, the rates' order alternating; blocks, notes and verdict."""
    import compression as cp

    rates = [p for p in args.placements if p in ("1gbit", "100mbit")]
    methods = args.methods.split(",")
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        for seed in range(args.seeds):
            for rate in harness.round_order(rates, seed):
                argv = [str(harness.python()), str(harness.HERE / "compression.py"), "--worker",
                        "--framework", "torch", "--dataset", "digits", "--seed", str(seed),
                        "--methods", ",".join(methods), "--out", f"{out}/{rate}",
                        "--target", str(args.target),
                        *[f"--extra={e}" for e in [*cp.SLOW, ONE_THREAD, *args.extra]]]
                found = run_on(rate, argv, cp.KEY, args.timeout)
                records += [{**r, "rate": rate} for r in found]
    blocks, notes, verdicts = [], [], []
    for rate in rates:
        table, verdict = compression_table([r for r in records if r["rate"] == rate], methods,
                                           rate == "100mbit")
        blocks.append(f"Over the {rate} link between the nodes:\n\n{table}")
        notes.append(f"Result, {rate}: {verdict}.")
        verdicts.append(f"{rate}: {verdict}")
    notes.insert(0, f"Workload: `compression.SLOW` (MLP 64-1024-1024-10 on digits, 5 epochs, "
                    f"constant learning rate, one compute thread a rank), 2 ranks over Gloo, one "
                    f"rank per node, seeds 0 to {args.seeds - 1}; time to {args.target} test "
                    "accuracy from the start of training, at the evaluation after each epoch. "
                    "Sooner = none's median / the method's; its interval pairs the runs by seed. "
                    "Replaces the single-host "
                    "network-namespace link of `compression.py`'s slow-link table.")
    return blocks, notes, "; ".join(verdicts)


def compression_table(records: list[dict], methods: Sequence[str], judged: bool) -> tuple[str, str]:
    """Per method: time to the target over the seeds and how much sooner than ``none``."""
    times = {m: [r["to_target_s"] for r in records if r["method"] == m] for m in methods}
    base = times.get("none", [])
    cells, best = [], None
    for m in methods:
        rs = [r for r in records if r["method"] == m]
        reached = [t for t in times[m] if t is not None]
        sooner, interval = "—", ""
        if base and None not in base and reached and len(reached) == len(times[m]):
            ratio = statistics.median(base) / statistics.median(reached)
            low, high = harness.ratio_interval(reached, base)
            sooner, interval = f"{ratio:.2f}", f"{low:.2f}-{high:.2f}"
            if m != "none" and (best is None or ratio > best[0]):
                best = (ratio, m, low)
        cells.append([m, f"{len(reached)}/{len(rs)}",
                      f"{statistics.median(reached):.1f} ({min(reached):.1f}-{max(reached):.1f})"
                      if reached else "—", sooner, interval,
                      f"{statistics.median(r['step_ms'] for r in rs):.0f}",
                      f"{statistics.median(r['ratio'] for r in rs):.1f}",
                      f"{statistics.median(r['accuracy'] for r in rs):.4f}"])
    header = ["method", "runs reaching it", "time to target median (min-max) s",
              "sooner than none (x)", "95% interval", "step ms", "byte ratio", "final accuracy"]
    if best is None:
        return harness.markdown_grid(header, cells), "no method reached the target in every run"
    status = "met" if best[0] >= SPEEDUP_TARGET else f"missed by {SPEEDUP_TARGET - best[0]:.1f}x"
    judgement = f": {status} (target >= {SPEEDUP_TARGET:g}x)" if judged else ""
    verdict = (f"{best[1]} reaches it {best[0]:.1f}x sooner than none (interval from "
               f"{best[2]:.1f}x)" + judgement)
    return harness.markdown_grid(header, cells), verdict


# Driver ------------------------------------------------------------------------------------------

PARTS = {"bandwidth": (bandwidth,
                       "Two nodes: allreduce bus bandwidth on shaped links against one host"),
         "training": (training, "Two nodes: hvdtrain samples/s on shaped links against one host"),
         "compression": (compression, "Two nodes: time to accuracy per compression method over "
                                      "1 Gbit/s and 100 Mbit/s links")}
LABELS = {"bandwidth": "Two nodes: allreduce bandwidth", "training": "Two nodes: samples/s",
          "compression": "Two nodes: compression"}
"""Each part's name in the index of docs/benchmarks.md."""


def target(args: argparse.Namespace) -> str:
    """The part's target in words, for the index."""
    return {"bandwidth": f"Horovod's allreduce time / the link rate's bound <= {1 / LINK_TARGET:.3f} "
                         f"(bus bandwidth >= {LINK_TARGET} x link rate) at {LINK_FROM >> 20} MB and "
                         "up, where the link limits",
            "training": "none (what a link costs)",
            "compression": f"best method reaches {args.target} accuracy >= {SPEEDUP_TARGET:g}x "
                           "sooner than `none` at 100 Mbit/s"}[args.part]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The driver's options; ``--quick`` measures the 100 Mbit/s link (and one host) only."""
    p = harness.parser("cluster.py", __doc__.splitlines()[0], SIZES, timeout=900.0)
    p.add_argument("--part", choices=PARTS, required=True)
    p.add_argument("--placements", help="comma-separated: one host, unshaped and rates "
                   f"({', '.join(RATES)}); default: all the part uses")
    p.add_argument("--sizes", help="bandwidth: sizes for every placement, e.g. 16M,64M")
    p.add_argument("--methods", default="none,fp16,topk,randomk,qsgd,powersgd")
    p.add_argument("--target", type=float, default=0.93, help="compression: test accuracy")
    p.add_argument("--extra", action="append", default=[], help="compression: config override")
    args = harness.parse(p, argv)
    if args.placements is None:
        full = {"bandwidth": "one host,unshaped,10gbit,1gbit,100mbit",
                "training": "one host,unshaped,10gbit,1gbit,100mbit",
                "compression": "1gbit,100mbit"}[args.part]
        args.placements = ("100mbit" if args.part == "compression" else "one host,100mbit") \
            if args.quick else full
        if args.quick and args.part == "bandwidth":
            args.sizes = args.sizes or "1M"
        if args.quick and args.part == "compression":
            args.methods, args.extra = "none,powersgd", args.extra or ["train.epochs=2"]
        args.command = harness.command_line(p, args)
    args.placements = args.placements.split(",")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one part, prints its section and, unless ``--no-write``, writes it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--allreduce-worker"]:
        return allreduce_job(argv[1:])
    args = parse_args(argv)
    part, title = PARTS[args.part]
    machine = harness.machine_record()
    with two_nodes():
        blocks, notes, verdict = part(args)
    entry = harness.Entry(label=LABELS[args.part], script=f"cluster.py --part {args.part}",
                          target=target(args), verdict=verdict)
    harness.publish(harness.section_text(title, args.command, machine, blocks, notes,
                                         entry=entry), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
