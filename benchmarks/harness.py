"""The benchmarks' machinery: options, jobs, interleaving, statistics, the Markdown record.

A baseline A, the candidates and A' (a copy of A: the A/A control) run in rounds, one run of each a
round, the order reversed every other round (A B A' / A' B A), after discarded warm-up rounds, so
that a busy spell of a shared machine hits all alike. Variants that can share processes run in one
``horovodrun`` job (``workload.job_main``); others run a job each
(:func:`run_jobs`). Rank 0 prints a JSON object a run; the driver groups them, summarises each
variant (:class:`Row`: median, spread, ratio to the baseline with its bootstrap interval), judges
the target beside the A/A control (:func:`judge`) and writes its section with the command that
reproduces it and its line of the index (:func:`publish`; ``index.py`` then regenerates the index
table of docs/benchmarks.md). No framework is imported here: drivers load in milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import index
from index import Entry

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DOC = ROOT / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n"
PACKAGES = ("torch", "horovod", "tensorflow", "tensorflow-cpu", "numpy")
"""Distributions whose versions :func:`machine_record` reports (when installed)."""

# Launchers tag each worker line with its rank: Gloo "[0]<stdout>:", Open MPI "[1,0]<stdout>:".
_RANK_TAG = re.compile(r"^\[[\d,]+\]<\w+>:")
Results = dict[str, list[dict[str, Any]]]
"""Each variant's per-run records, one per measured round, by table name (:func:`group_runs`)."""
T = TypeVar("T")


class BenchError(RuntimeError):
    """A benchmark job failed or printed fewer measurements than it should have."""


# Statistics --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One variant's samples summarised, and its median relative to the baseline's."""

    name: str
    runs: int
    min: float
    median: float
    max: float
    ratio: float
    """This variant's median / the baseline's median (1.0 for the baseline itself)."""
    low: float
    high: float
    """The ratio's 95% bootstrap interval (:func:`ratio_interval`)."""


def ratio_interval(base: Sequence[float], values: Sequence[float], resamples: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """The 95% bootstrap interval of ``median(values) / median(base)``.

    Samples of equal count are taken as paired by round and resampled together, so that a slow
    round weighs on both sides; otherwise each side is resampled on its own. Seeded: the same
    samples always give the same interval.
    """
    rng = random.Random(seed)
    paired = len(base) == len(values)
    draws = []
    for _ in range(resamples):
        if paired:
            picks = [rng.randrange(len(base)) for _ in base]
            b, v = [base[i] for i in picks], [values[i] for i in picks]
        else:
            b, v = rng.choices(base, k=len(base)), rng.choices(values, k=len(values))
        draws.append(statistics.median(v) / statistics.median(b))
    draws.sort()
    return draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]


def summarize(samples: Mapping[str, Sequence[float]], baseline: str) -> list[Row]:
    """A :class:`Row` per variant, in the order of ``samples``.

    Raises ``ValueError`` when ``baseline`` is not a variant, a variant has no samples, or the
    baseline's median is not positive.
    """
    if baseline not in samples:
        raise ValueError(f"baseline {baseline!r} is not among the variants: {', '.join(samples)}")
    empty = [name for name, values in samples.items() if not values]
    if empty:
        raise ValueError(f"no samples for: {', '.join(empty)}")
    base = statistics.median(samples[baseline])
    if base <= 0:
        raise ValueError(f"baseline {baseline!r} has a non-positive median ({base})")
    rows = []
    for name, values in samples.items():
        low, high = ratio_interval(samples[baseline], values)
        median = statistics.median(values)
        rows.append(Row(name, len(values), min(values), median, max(values), median / base, low,
                        high))
    return rows


@dataclass(frozen=True)
class Verdict:
    """A ratio judged against its target beside the A/A control's ratio."""

    status: str
    """``met``, ``missed``, or ``inconclusive`` (the A/A control is off by more than the
    tolerance: the machine was too noisy to tell)."""
    ratio: float
    control: float
    target: float
    tolerance: float
    higher_is_better: bool = False

    def __str__(self) -> str:
        sign = ">=" if self.higher_is_better else "<="
        return (f"{self.ratio:.3f}, A/A control {self.control:.3f}: {self.status} (target "
                f"{sign} {self.target}, judged where the A/A control is within "
                f"{self.tolerance:.0%} of 1)")


def judge(ratio: float, control: float, target: float, tolerance: float = 0.10, *,
          higher_is_better: bool = False) -> Verdict:
    """Judges ``ratio`` against ``target``, or not at all when ``control`` strays from 1 by more
    than ``tolerance``."""
    if abs(control - 1.0) > tolerance:
        status = "inconclusive"
    else:
        met = ratio >= target if higher_is_better else ratio <= target
        status = "met" if met else "missed"
    return Verdict(status, ratio, control, target, tolerance, higher_is_better)


def brief(verdict: Verdict, row: Row | None = None) -> str:
    """``verdict`` in a few words, for a section's index line: status (a miss with its distance to
    the target), ratio (with ``row``'s 95% interval when given) and the A/A control. A rate's
    ratios (``higher_is_better``) are given as time ratios, their inverse: above 1 is slower."""
    if verdict.higher_is_better:  # a rate: its time ratio, docs/benchmarks.md's convention
        interval = f" (interval {1 / row.high:.3f}-{1 / row.low:.3f})" if row else ""
        ratio, control, target = 1 / verdict.ratio, 1 / verdict.control, 1 / verdict.target
    else:
        interval = f" (interval {row.low:.3f}-{row.high:.3f})" if row else ""
        ratio, control, target = verdict.ratio, verdict.control, verdict.target
    status = verdict.status
    if status == "missed":  # a miss says by how much (docs/benchmarks.md's verdicts)
        status = f"missed by {abs(ratio - target):.3f}"
    rate = f" (rate ratio {verdict.ratio:.3f})" if verdict.higher_is_better else ""
    return f"{status}: {ratio:.3f}{interval}{rate}, A/A {control:.3f}"


def by_name(rows: Sequence[Row]) -> dict[str, Row]:
    """The rows keyed by variant name."""
    return {row.name: row for row in rows}


# Markdown ----------------------------------------------------------------------------------------

TABLE_COLUMNS = ("name", "runs", "min", "median", "max", "ratio to baseline", "ratio 95% interval")
"""The columns of :func:`markdown_table` (the value columns carry their unit)."""


def markdown_grid(header: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    """A Markdown table of preformatted ``cells``: first column left-aligned, the others right."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def markdown_table(rows: Sequence[Row], *, unit: str = "ms", scale: float = 1e3,
                   digits: int = 3) -> str:
    """The rows under :data:`TABLE_COLUMNS`, values times ``scale`` in ``unit``; the baseline's
    interval (the first row's) is left blank."""
    header = [c if c in ("name", "runs") or c.startswith("ratio") else f"{c} ({unit})"
              for c in TABLE_COLUMNS]
    cells = []
    for position, row in enumerate(rows):
        values = [f"{v * scale:.{digits}f}" for v in (row.min, row.median, row.max)]
        interval = "" if position == 0 else f"{row.low:.3f}-{row.high:.3f}"
        cells.append([row.name, str(row.runs), *values, f"{row.ratio:.3f}", interval])
    return markdown_grid(header, cells)


def machine_record() -> dict[str, Any]:
    """What the numbers were measured on: ``cpu``, ``cores``, ``os``, ``python``, the version of
    each installed package of :data:`PACKAGES` (from metadata, never imported) and ``loadavg``."""
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                cpu = line.split(":", 1)[1].strip()
                break
    record: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count() or 0,
                              "os": platform.platform(), "python": platform.python_version()}
    for name in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            record[name] = metadata.version(name)
    if hasattr(os, "getloadavg"):  # a shared machine: how busy it was when the benchmark started
        record["loadavg"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return record


def commit_record(root: Path = ROOT) -> str:
    """The commit a benchmark runs at, for its section's ``Commit:`` line: the short hash of HEAD,
    with a note where the package or the benchmarks differ from it; ``unknown`` outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hvdtrain", "benchmarks"],
                               cwd=root, check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head} (with uncommitted changes to hvdtrain/ or benchmarks/)" if dirty else head


def section_text(title: str, command: str, machine: Mapping[str, Any], blocks: Sequence[str],
                 notes: Sequence[str] = (), *, entry: Entry | None = None,
                 date: str | None = None, commit: str | None = None) -> str:
    """A dated Markdown section: title, ``entry``'s index, verdict, figure and target lines (the
    row of docs/benchmarks.md's index: ``index.py``), the date and commit, the command that
    reproduces it, the machine, ``blocks`` (finished pieces of Markdown, such as captioned
    tables), then the notes as a list."""
    date = date or _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    machine_text = "; ".join(f"{key}: {value}" for key, value in machine.items())
    parts = [f"## {title}", ""]
    if entry:
        parts += [entry.lines().rstrip("\n"), ""]
    parts += [f"Date: {date}", "", f"Commit: {commit or commit_record()}", "",
              "Reproduce (from the repository root):", "",
              "```", command, "```", "", f"Machine: {machine_text}.", ""]
    for block in blocks:
        parts += [block.rstrip("\n"), ""]
    parts += [f"- {note}" for note in notes]
    return "\n".join(parts).rstrip("\n") + "\n"


def table_block(caption: str, rows: Sequence[Row], **fmt: Any) -> str:
    """``caption``, a blank line and the rows' :func:`markdown_table` (``fmt``: its units)."""
    table = markdown_table(rows, **fmt)
    return f"{caption}\n\n{table}" if caption else table


def put_section(path: Path, section: str, header: str = HEADER) -> None:
    """Puts ``section`` into the Markdown file ``path`` in place of the section with the same
    ``## `` heading (older copies go), else at the end; creates the file with ``header`` first.
    Then regenerates the file's index, where it has one (:func:`index.refresh`)."""
    _put(path, section, header)
    index.refresh(path)


def _put(path: Path, section: str, header: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = path.read_text() if path.exists() else header.rstrip("\n") + "\n"
    heading = section.lstrip("\n").splitlines()[0]
    parts = re.split(r"(?m)^(?=## )", existing)  # part 0 is the header, each other one section
    same = [i for i, part in enumerate(parts) if part.splitlines()[0:1] == [heading]]
    if not same:
        path.write_text(existing.rstrip("\n") + "\n\n" + section)
        return
    parts[same[0]] = section.rstrip("\n") + "\n\n"
    kept = [part for i, part in enumerate(parts) if i not in same[1:]]
    path.write_text("".join(kept).rstrip("\n") + "\n")


# Records of a job --------------------------------------------------------------------------------

def parse_measurements(output: str, key: str) -> list[dict[str, Any]]:
    """Every JSON object in ``output`` that holds ``key``, one a line, in order.

    A launcher's rank tag in front is ignored, and so is text after the object (Open MPI's output
    tagging can glue the next line's tag onto it). Other lines are skipped.
    """
    decoder, found = json.JSONDecoder(), []
    for line in output.splitlines():
        text = _RANK_TAG.sub("", line.strip(), count=1).strip()
        if not text.startswith("{"):
            continue
        try:
            obj, _ = decoder.raw_decode(text)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and key in obj:
            found.append(obj)
    return found


def round_order(items: Sequence[T], round_index: int) -> list[T]:
    """The variants' order in round ``round_index``: as given on even rounds, reversed on odd
    ones (warm-up rounds have negative indices)."""
    return list(items) if round_index % 2 == 0 else list(reversed(items))


def group_runs(records: Sequence[Mapping[str, Any]], names: Sequence[str], rounds: int) -> Results:
    """The measured runs of each variant from records holding ``slot`` (the index in ``names``)
    and ``round`` (negative: warm-up, dropped). Raises :class:`BenchError` unless every slot has
    exactly ``rounds`` runs: a job that died half-way must not pass for a shorter benchmark."""
    results: Results = {name: [] for name in names}
    if len(results) != len(names):
        raise ValueError(f"variant names must be unique: {list(names)}")
    for record in records:
        if record["round"] >= 0:
            results[names[record["slot"]]].append(dict(record))
    short = [f"{name} ({len(runs)})" for name, runs in results.items() if len(runs) != rounds]
    if short:
        raise BenchError(f"expected {rounds} runs of every variant, got: {', '.join(short)}")
    return results


def samples_of(results: Results, key: str) -> dict[str, list[float]]:
    """The values of ``key`` in each variant's runs."""
    return {name: [float(m[key]) for m in runs] for name, runs in results.items()}


# Launching ---------------------------------------------------------------------------------------

def python() -> Path:
    """This interpreter's absolute path, symlinks kept (``.venv/bin/python`` stays the venv's)."""
    return Path(os.path.abspath(sys.executable))


def horovodrun() -> str:
    """The ``horovodrun`` next to this interpreter (the project's .venv), else the one on PATH."""
    local = python().parent / "horovodrun"
    found = str(local) if local.exists() else shutil.which("horovodrun")
    if not found:
        raise SystemExit("horovodrun not found; run `make setup` first")
    return found


def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The jobs' environment: Open MPI allowed to start as root; ``extra`` added last."""
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.update(extra or {})
    return env


def log(message: str) -> None:
    """A progress line on stderr (stdout carries the section)."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run_job(argv: Sequence[str], key: str, timeout: float, env: Mapping[str, str] | None = None,
            on_record: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Runs one job and returns every record holding ``key`` that it printed, passing each to
    ``on_record`` as it comes. Raises :class:`BenchError` with the output's tail when the job
    fails or outlives ``timeout`` seconds."""
    # Long enough to hold a rank's own error above a launcher's closing report.
    tail: deque[str] = deque(maxlen=120)
    records: list[dict[str, Any]] = []
    started = time.monotonic()
    # One pipe for both streams (two read in turn could deadlock); a session of its own lets the
    # timeout kill the workers too, not only the launcher.
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=worker_env(env), start_new_session=True) as proc:
        timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                tail.append(line.rstrip("\n"))
                for record in parse_measurements(line, key):
                    records.append(record)
                    log(f"{key}={record[key]:.6g} {record.get('variant', '')}")
                    if on_record:
                        on_record(record)
        finally:
            timer.cancel()
    if proc.returncode != 0:
        reason = (f"no result within {timeout:g} s" if time.monotonic() - started >= timeout
                  else f"exit code {proc.returncode}")
        raise BenchError(f"benchmark job: {reason}\n" + "\n".join(tail))
    return records


@dataclass(frozen=True)
class Job:
    """A variant that is a job of its own: table name, command line, extra environment."""

    name: str
    argv: list[str]
    env: dict[str, str]


def run_jobs(jobs: Sequence[Job], rounds: int, warmup: int, key: str, timeout: float) -> Results:
    """Runs every job once per round in :func:`round_order`, after ``warmup`` discarded rounds;
    each job must print exactly one record holding ``key``."""
    records = []
    for round_index in range(-warmup, rounds):
        for slot, job in round_order(list(enumerate(jobs)), round_index):
            found = run_job(job.argv, key, timeout, job.env)
            if len(found) != 1:
                raise BenchError(f"{job.name}: expected one measurement, got {len(found)}")
            records.append({**found[0], "round": round_index, "slot": slot, "variant": job.name})
    return group_runs(records, [job.name for job in jobs], rounds)


@dataclass(frozen=True)
class Variant:
    """A variant of an interleaved job: its table name and ``module:key`` of its run function
    (``VARIANTS[key]`` of that worker module in this directory)."""

    name: str
    spec: str


def run_interleaved(variants: Sequence[Variant], args: argparse.Namespace, key: str) -> Results:
    """Runs ``variants`` interleaved in one ``horovodrun`` job (``workload.job_main``) with the job
    options of ``args``; writes each record to ``args.records`` as it comes, when given."""
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as work, \
            (args.records.open("w") if args.records else contextlib.nullcontext()) as out:
        argv = [horovodrun(), "-np", str(args.np), f"--{args.controller}", str(python()),
                str(HERE / "workload.py"), "--variants", ",".join(v.spec for v in variants),
                "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--epochs",
                str(args.epochs), "--out-dir", work,
                *[flag for flag in ("--bind", "--spin") if getattr(args, flag[2:])]]
        keep = (lambda r: print(json.dumps(r), file=out, flush=True)) if out else None
        records = run_job(argv, key, args.timeout, on_record=keep)
    return group_runs(records, [v.name for v in variants], args.rounds)


def measure(variants: Sequence[Variant], args: argparse.Namespace,
            keys: Sequence[str]) -> tuple[dict[str, Any], Results, list[list[Row]]]:
    """The machine, the records of :func:`run_interleaved` and, for each of ``keys``, the rows of
    every variant against the first."""
    machine = machine_record()  # before the job: the load average shows what else was running
    results = run_interleaved(variants, args, keys[0])
    tables = [summarize(samples_of(results, key), variants[0].name) for key in keys]
    return machine, results, tables


# Options -----------------------------------------------------------------------------------------

_NOT_REPRODUCED = {"help", "quick", "no_write", "output", "timeout", "records"}


def parser(script: str | Path, description: str, sizes: Mapping[str, tuple[int, int]],
           interleaved: bool = False, timeout: float = 1200.0) -> argparse.ArgumentParser:
    """A driver's parser: ``--NAME`` for each of ``sizes`` (``name: (full, quick)``, unset
    values taken from the pair by ``--quick``), ``--quick``, ``--no-write``, ``--output`` and
    ``--timeout``; with ``interleaved``, the job's ``--np``, ``--controller``, ``--bind``,
    ``--spin`` and ``--records``. A driver adds its own options before :func:`parse`.

    ``script`` is the driver's file name in this directory, or the path of a driver elsewhere in
    the checkout (an investigation's, under ``docs/investigations/``)."""
    p = argparse.ArgumentParser(description=description)
    for name, (full, quick) in sizes.items():
        p.add_argument(f"--{name}", type=int, help=f"default {full}, --quick: {quick}")
    p.add_argument("--quick", action="store_true", help="a tiny end-to-end check")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    p.add_argument("--output", type=Path, default=DOC, help="the Markdown file to write")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds per job")
    if interleaved:
        p.add_argument("--np", type=int, default=2, help="ranks of the job (default 2)")
        p.add_argument("--controller", choices=("gloo", "mpi"), default="gloo")
        p.add_argument("--bind", action=argparse.BooleanOptionalAction, default=False,
                       help="pin each rank to one core, as `srun --cpu-bind=cores` would")
        p.add_argument("--spin", action=argparse.BooleanOptionalAction, default=False,
                       help="an idle-class busy loop beside each rank (workload.idle_spinner)")
        p.add_argument("--records", type=Path, help="also write every run's record here (JSONL)")
    script_path = (HERE / script).resolve().relative_to(ROOT)  # HERE / an absolute path: that path
    p.set_defaults(script=script_path.as_posix(), size_defaults=dict(sizes))
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses ``argv``; fills unset sizes from ``--quick`` or the full run, checks ``--rounds``
    and ``--warmup``, and sets ``command``: the command line that repeats this run."""
    args = p.parse_args(argv)
    for name, (full, quick) in args.size_defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if getattr(args, "rounds", 1) < 1 or getattr(args, "warmup", 0) < 0:
        p.error("--rounds must be positive and --warmup not negative")
    args.command = command_line(p, args)
    return args


def command_line(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """Every option of ``args`` spelled out after the script (lists repeat their flag), as a
    reader types it from the repository root."""
    interpreter = python()
    if interpreter.is_relative_to(ROOT):
        interpreter = interpreter.relative_to(ROOT)
    argv = [str(interpreter), args.script]
    for action in p._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in _NOT_REPRODUCED or value is None:
            continue
        flag = next(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif action.nargs == 0:
            argv += [flag] if value else []
        elif isinstance(value, list):
            argv += [part for item in value for part in (flag, str(item))]
        else:
            argv += [flag, str(value)]
    return shlex.join(argv)


def publish(section: str, args: argparse.Namespace) -> None:
    """Prints ``section`` and, unless ``--no-write``, puts it into ``args.output``."""
    print(section)
    if not args.no_write:
        put_section(args.output, section)
        log(f"written to {args.output}")


def env_pairs(items: Sequence[str]) -> dict[str, str]:
    """``NAME=VALUE`` options as a dict; raises ``SystemExit`` on an item without ``=``."""
    if any("=" not in item for item in items):
        raise SystemExit("--env takes NAME=VALUE")
    return dict(item.split("=", 1) for item in items)
