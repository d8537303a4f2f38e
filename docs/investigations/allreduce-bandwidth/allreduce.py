"""Allreduce bandwidth: Horovod over Gloo and MPI against its raw backend and a memory copy.

Two ``horovodrun -np 2`` jobs (``allreduce_worker.py``): over Gloo, Horovod's allreduce against raw
``torch.distributed`` Gloo; over MPI, against raw ``mpi4py`` ``Allreduce``. In each job every
message size from 4 KB to 256 MB is timed in rounds interleaving the raw backend (A), Horovod (B),
the raw backend again (A', the A/A control) and a memory copy of the same size (C, the ceiling),
all in place on float32 buffers. Per size: algorithm and bus bandwidth (nccl-tests' definitions),
each variant against the copy, Horovod against its raw backend beside the A/A control. Target:
Horovod >= 0.8x its raw backend at 64 MB and above.

It measures Horovod itself, not hvdtrain, so it lives with its investigation
(``docs/investigations/allreduce-bandwidth.md``, where it writes its section by default); the
harness and ``allreduce_worker.py`` (which ``benchmarks/cluster.py`` shares) stay in
``benchmarks/``.

Usage (from the repository root; ``DRIVER=docs/investigations/allreduce-bandwidth/allreduce.py``)::

    .venv/bin/python $DRIVER
    .venv/bin/python $DRIVER --quick --no-write                 # a tiny end-to-end check
    .venv/bin/python $DRIVER --env HOROVOD_CYCLE_TIME=0.1       # a Horovod knob
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the harness and the worker
import harness  # noqa: E402
from allreduce_records import CONTROL, COPY, HOROVOD, KEY, RAW, Tables, bus, by_size, human  # noqa: E402  (the record format, with cluster.py)

NOTE = ROOT / "docs" / "investigations" / "allreduce-bandwidth.md"
"""Where a run writes its section (``--output`` by default)."""

TARGET, TARGET_FROM = 0.8, 64 << 20
FULL_SIZES = ",".join(str(4 << 10 << (2 * i)) for i in range(9))  # 4 KB, 16 KB, ..., 256 MB
QUICK_SIZES = f"{4 << 10},{64 << 10}"
SIZES = {"rounds": (5, 1), "warmup": (1, 0), "budget": (32 << 20, 256 << 10)}
HEADER = ["size", "raw algbw median (min-max) GB/s", "Horovod algbw median (min-max) GB/s",
          "raw busbw", "Horovod busbw", "memory copy GB/s", "raw / copy", "Horovod / copy",
          "Horovod / raw", "A/A control"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--quick`` sets two small sizes, one round and a small budget."""
    p = harness.parser(Path(__file__), __doc__.splitlines()[0], SIZES, timeout=900.0)
    p.set_defaults(output=NOTE)
    p.add_argument("--sizes", help="comma-separated bytes (default 4 KB to 256 MB, x4 steps)")
    p.add_argument("--max-iters", type=int, default=100, help="most operations per timed run")
    p.add_argument("--np", type=int, default=2, help="ranks per job (default 2)")
    p.add_argument("--controllers", default="gloo,mpi", help="jobs to run, from gloo,mpi")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment variable for the jobs, e.g. HOROVOD_CYCLE_TIME=0.1")
    args = harness.parse(p, argv)
    if args.sizes is None:
        args.sizes = QUICK_SIZES if args.quick else FULL_SIZES
        args.command = harness.command_line(p, args)
    if not set(args.controllers.split(",")) <= {"gloo", "mpi"}:
        p.error("--controllers takes gloo and/or mpi")
    return args


def table_row(size: int, rows: list[harness.Row], ranks: int) -> list[str]:
    """One size's cells under :data:`HEADER`."""
    raw, hvd, control, copy = rows[RAW], rows[HOROVOD], rows[CONTROL], rows[COPY]

    def spread(row: harness.Row) -> str:
        return f"{row.median:.3g} ({row.min:.3g}-{row.max:.3g})"

    return [human(size), spread(raw), spread(hvd), f"{bus(raw.median, ranks):.3g}",
            f"{bus(hvd.median, ranks):.3g}", f"{copy.median:.3g}",
            f"{raw.median / copy.median:.3g}", f"{hvd.median / copy.median:.3g}",
            f"{hvd.ratio:.3f}", f"{control.ratio:.3f}"]


def verdict(tables: Tables) -> harness.Verdict | None:
    """Horovod / raw at the worst size from 64 MB, judged beside the A/A control farthest from 1
    among those sizes; ``None`` when no such size was measured."""
    big = [rows for size, rows in tables.items() if size >= TARGET_FROM]
    if not big:
        return None
    worst = min(rows[HOROVOD].ratio for rows in big)
    control = max((rows[CONTROL].ratio for rows in big), key=lambda c: abs(c - 1))
    return harness.judge(worst, control, TARGET, higher_is_better=True)


def block(controller: str, args: argparse.Namespace, tables: Tables) -> str:
    """One job's captioned table."""
    raw_name = tables[min(tables)][RAW].name.removesuffix(" (A)")
    caption = (f"Horovod over {controller} (`horovodrun -np {args.np} --{controller}`): raw = "
               f"{raw_name}; copy = `numpy.copyto` of the same size on each rank at once:")
    cells = [table_row(size, rows, args.np) for size, rows in tables.items()]
    return f"{caption}\n\n{harness.markdown_grid(HEADER, cells)}"


def notes(args: argparse.Namespace, all_tables: dict[str, Tables]) -> list[str]:
    """The lines under the tables: method, definitions, the verdicts."""
    spreads = [abs(rows[CONTROL].ratio - 1) for t in all_tables.values() for rows in t.values()]
    results = [f"Result, {c}: Horovod / raw at >= 64 MB, worst size: "
               f"{verdict(t) or 'not measured'}." for c, t in all_tables.items()]
    return [
        f"Per size: {args.rounds} rounds after {args.warmup} warm-up of A B A' C (reversed on "
        f"odd rounds); a run is about {human(args.budget)} of back-to-back in-place float32 sums "
        f"(1 to {args.max_iters} operations) after a barrier, timed on rank 0; each variant's "
        "result checked once per size.",
        "algbw = bytes / seconds per operation; busbw = algbw x 2(n-1)/n (nccl-tests).",
        f"A/A control: median |A'/A - 1| over all sizes and jobs {statistics.median(spreads):.3f}.",
        f"Extra environment: {' '.join(args.env) or 'none (Horovod defaults)'}.",
        *results,
    ]


def job_argv(args: argparse.Namespace, controller: str) -> list[str]:
    """The ``horovodrun`` command line of one controller's job."""
    return [harness.horovodrun(), "-np", str(args.np), f"--{controller}", str(harness.python()),
            str(harness.HERE / "allreduce_worker.py"), "--sizes", args.sizes, "--rounds",
            str(args.rounds), "--warmup", str(args.warmup), "--budget", str(args.budget),
            "--max-iters", str(args.max_iters)]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one job per controller, prints the section and, unless ``--no-write``, writes it."""
    args = parse_args(argv)
    machine = harness.machine_record()
    env = harness.env_pairs(args.env)
    all_tables = {c: by_size(harness.run_job(job_argv(args, c), KEY, args.timeout, env),
                             args.rounds) for c in args.controllers.split(",")}
    blocks = [block(c, args, t) for c, t in all_tables.items()]
    harness.publish(harness.section_text(
        f"Allreduce bandwidth at {args.np} processes: Horovod vs its raw backend vs memory copy",
        args.command, machine, blocks, notes(args, all_tables)), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
