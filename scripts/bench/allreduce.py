"""Allreduce bandwidth: Horovod over Gloo and MPI against its raw backend and a memory copy.

Two ``horovodrun -np 2`` jobs (``allreduce_worker.py``): over Gloo, Horovod's allreduce against
raw ``torch.distributed`` Gloo; over MPI, Horovod's allreduce against raw ``mpi4py``
``Allreduce``. In each job, every message size from 4 KB to 256 MB is timed in rounds that
interleave the raw backend (A), Horovod (B), the raw backend again (A', the A/A control) and a
memory copy of the same size (C, the ceiling), all in place on float32 buffers. Reported per size:
algorithm bandwidth (bytes / time per operation) and bus bandwidth (nccl-tests' definition for
allreduce: algbw x 2(n-1)/n), each variant's ratio to the memory copy, and Horovod's ratio to its
raw backend beside the A/A control's. Target: Horovod >= 0.8x its raw backend at 64 MB and above.

Usage (from the repository root)::

    .venv/bin/python scripts/bench/allreduce.py                      # writes its section of docs/benchmarks.md
    .venv/bin/python scripts/bench/allreduce.py --quick --no-write    # a tiny end-to-end check
    .venv/bin/python scripts/bench/allreduce.py --env HOROVOD_CYCLE_TIME=0.1   # a Horovod knob
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from typing import Any, Sequence

import harness
import launch

KEY = "algbw_GBps"
TARGET = 0.8
TARGET_FROM = 64 << 20
SIZES = [4 << 10 << (2 * i) for i in range(9)]  # 4 KB, 16 KB, ..., 256 MB
QUICK_SIZES = [4 << 10, 64 << 10]
CONTROLLERS = ("gloo", "mpi")
RAW, HOROVOD, CONTROL, COPY = 0, 1, 2, 3
"""The worker's slots: raw backend (A), Horovod (B), raw again (A'), memory copy (C)."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--quick`` changes the defaults of sizes, rounds and warm-up only."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", help="comma-separated bytes (default 4 KB to 256 MB, x4 steps)")
    parser.add_argument("--rounds", type=int, help="measured rounds per size (default 5)")
    parser.add_argument("--warmup", type=int, help="discarded rounds per size first (default 1)")
    parser.add_argument("--budget", type=int,
                        help="bytes per timed run; iterations = budget / size, 1 to 100 "
                             "(default 32 MB; --quick: 256 KB)")
    parser.add_argument("--max-iters", type=int, default=100,
                        help="most operations per timed run (default 100)")
    parser.add_argument("--np", type=int, default=2, help="ranks per job (default 2)")
    parser.add_argument("--controllers", default=",".join(CONTROLLERS),
                        help="jobs to run, from gloo,mpi (default both)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment variable for the jobs, e.g. HOROVOD_CYCLE_TIME=0.1")
    parser.add_argument("--quick", action="store_true", help="tiny check: 4 KB and 64 KB, 1 round")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    parser.add_argument("--output", type=launch.Path,
                        default=launch.ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    args = parser.parse_args(argv)
    args.sizes = ([int(s) for s in args.sizes.split(",")] if args.sizes
                  else QUICK_SIZES if args.quick else SIZES)
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.budget = args.budget or (256 << 10 if args.quick else 32 << 20)
    args.warmup = (0 if args.quick else 1) if args.warmup is None else args.warmup
    args.controllers = args.controllers.split(",")
    if not set(args.controllers) <= set(CONTROLLERS) or args.rounds < 1 or min(args.sizes) < 4:
        parser.error("--controllers takes gloo and/or mpi; --rounds >= 1; sizes >= 4 bytes")
    if any("=" not in item for item in args.env):
        parser.error("--env takes NAME=VALUE")
    return args


def job_command(args: argparse.Namespace, controller: str) -> list[str]:
    """The ``horovodrun`` command line of one controller's job."""
    return [launch.horovodrun(), "-np", str(args.np), f"--{controller}", str(launch.python()),
            str(launch.HERE / "allreduce_worker.py"), "--sizes", ",".join(map(str, args.sizes)),
            "--rounds", str(args.rounds), "--warmup", str(args.warmup),
            "--budget", str(args.budget), "--max-iters", str(args.max_iters)]


def by_size(records: Sequence[dict[str, Any]], rounds: int) -> dict[int, list[harness.Row]]:
    """Each size's rows (A, B, A', C in slot order), ratios to the raw backend A."""
    tables: dict[int, list[harness.Row]] = {}
    for size in sorted({r["size"] for r in records}):
        mine = [r for r in records if r["size"] == size]
        names = [next(r["variant"] for r in mine if r["slot"] == slot)
                 for slot in sorted({r["slot"] for r in mine})]
        grouped = harness.group_runs(mine, names, rounds)
        tables[size] = harness.summarize(harness.samples_of(grouped, KEY), baseline=names[RAW])
    return tables


def human(size: int) -> str:
    """``4 KB``, ``1 MB``, ``256 MB``: binary units, as the sizes are powers of two."""
    for unit, shift in (("GB", 30), ("MB", 20), ("KB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):g} {unit}"
    return f"{size} B"


def bus(algbw: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth of an allreduce: what each link carried, comparable across n."""
    return algbw * 2 * (ranks - 1) / ranks


HEADER = ["size", "raw algbw median (min-max) GB/s", "Horovod algbw median (min-max) GB/s",
          "raw busbw", "Horovod busbw", "memory copy GB/s", "raw / copy", "Horovod / copy",
          "Horovod / raw", "A/A control"]


def table_row(size: int, rows: list[harness.Row], ranks: int) -> list[str]:
    """One size's cells: medians with their spread, bus bandwidths and the ratios."""
    raw, hvd, control, copy = rows[RAW], rows[HOROVOD], rows[CONTROL], rows[COPY]

    def spread(row: harness.Row) -> str:
        return f"{row.median:.3g} ({row.min:.3g}-{row.max:.3g})"

    return [human(size), spread(raw), spread(hvd), f"{bus(raw.median, ranks):.3g}",
            f"{bus(hvd.median, ranks):.3g}", f"{copy.median:.3g}",
            f"{raw.median / copy.median:.3g}", f"{hvd.median / copy.median:.3g}",
            f"{hvd.ratio:.3f}", f"{control.ratio:.3f}"]


def verdict(controller: str, tables: dict[int, list[harness.Row]]) -> str:
    """Whether Horovod reached ``TARGET`` of its raw backend at every size from 64 MB."""
    big = {size: rows for size, rows in tables.items() if size >= TARGET_FROM}
    if not big:
        return f"{controller}: no size of 64 MB or more was measured, so the target is not judged"
    ratios = ", ".join(f"{human(s)} {rows[HOROVOD].ratio:.2f} (A/A {rows[CONTROL].ratio:.2f})"
                       for s, rows in big.items())
    met = all(rows[HOROVOD].ratio >= TARGET for rows in big.values())
    worst = max(big.values(), key=lambda rows: abs(rows[CONTROL].ratio - 1))[CONTROL].ratio
    return (f"{controller}: Horovod / raw at >= 64 MB: {ratios}: target >= {TARGET} "
            f"{harness.judge(met, worst)}")


def block(controller: str, args: argparse.Namespace, tables: dict[int, list[harness.Row]]) -> str:
    """One job's captioned table."""
    names = tables[min(tables)]
    caption = (f"Horovod over {controller} (`horovodrun -np {args.np} --{controller}`): raw = "
               f"{names[RAW].name.removesuffix(' (A)')}; copy = `numpy.copyto` of the same size "
               "on each rank at once:")
    cells = [table_row(size, rows, args.np) for size, rows in tables.items()]
    return f"{caption}\n\n{harness.markdown_grid(HEADER, cells)}"


def notes(args: argparse.Namespace, verdicts: list[str],
          all_tables: dict[str, dict[int, list[harness.Row]]]) -> list[str]:
    """The lines under the tables: method, definitions, the verdicts."""
    spreads = [abs(rows[CONTROL].ratio - 1) for t in all_tables.values() for rows in t.values()]
    return [
        f"Per size: {args.rounds} measured rounds after {args.warmup} warm-up, each running "
        "A B A' C "
        "(reversed on odd rounds); a run is about "
        f"{human(args.budget)} of back-to-back in-place float32 sums (1 to {args.max_iters} "
        "operations) after a "
        "barrier, timed on rank 0. Each variant's result was checked once per size (ones summed "
        "over the ranks give the world size).",
        "algbw = bytes / seconds per operation; busbw = algbw x 2(n-1)/n (nccl-tests), here x "
        f"{2 * (args.np - 1) / args.np:g}. `/ copy` divides by the memory copy's algbw.",
        "A/A control: the raw backend's second copy over its first; median |A'/A - 1| over all "
        f"sizes and jobs: {statistics.median(spreads):.3f}. A Horovod/raw ratio no farther from 1 "
        "than that is noise.",
        f"Extra environment: {' '.join(args.env) or 'none (Horovod defaults)'}.",
        *[f"Result, {v}." for v in verdicts],
    ]


def reproduce(args: argparse.Namespace) -> str:
    """The command line that repeats this benchmark."""
    argv = [str(launch.reproduce_interpreter()), "scripts/bench/allreduce.py", "--sizes",
            ",".join(map(str, args.sizes)), "--rounds", str(args.rounds), "--warmup",
            str(args.warmup), "--budget", str(args.budget), "--max-iters", str(args.max_iters),
            "--np", str(args.np),
            "--controllers", ",".join(args.controllers)]
    for item in args.env:
        argv += ["--env", item]
    return shlex.join(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one job per controller, prints the section and, unless ``--no-write``, writes it."""
    args = parse_args(argv)
    machine = harness.machine_record()
    env = dict(item.split("=", 1) for item in args.env)
    all_tables = {}
    for controller in args.controllers:
        records = launch.run_job(job_command(args, controller), KEY, args.timeout, env)
        all_tables[controller] = by_size(records, args.rounds)
    blocks = [block(c, args, t) for c, t in all_tables.items()]
    verdicts = [verdict(c, t) for c, t in all_tables.items()]
    launch.publish(harness.section_text(
        f"Allreduce bandwidth at {args.np} processes: Horovod vs its raw backend vs memory copy",
        reproduce(args), machine, blocks, notes(args, verdicts, all_tables)), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
