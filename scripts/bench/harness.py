"""A small benchmark harness: interleaved runs, medians, ratios, an A/A control, a Markdown record.

Each compared command is a subprocess that prints one JSON object on a line of its stdout (possibly
behind a launcher's ``[rank]<stdout>:`` tag) holding its measurements. The harness runs the
commands in rounds, one run of each per round, so that a slow period of a shared machine hits every
command alike rather than whichever ran during it. The order within a round is reversed on every
other round (A B A' / A' B A), so that no command always follows the same neighbour. The first
command is the baseline, and a second copy of it (the A/A control) shows how far two identical
commands disagree on this machine: a ratio is only meaningful when it differs from 1 by more than
the control does.

The statistics and formatting functions (:func:`summarize`, :func:`markdown_table`,
:func:`markdown_section`, :func:`parse_measurement`) are pure; :func:`machine_record` only reads
files and package metadata. The harness imports no framework, so it measures nothing by accident
and loads in milliseconds.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

PACKAGES = ("torch", "horovod", "tensorflow", "tensorflow-cpu", "numpy")
"""Distributions whose versions :func:`machine_record` reports (when installed)."""

# Launchers tag each worker line with its rank: Gloo as "[0]<stdout>:", Open MPI as "[1,0]<stdout>:".
_RANK_TAG = re.compile(r"^\[[\d,]+\]<\w+>:")


class BenchError(RuntimeError):
    """A benchmarked command failed or printed no measurement."""


@dataclass(frozen=True)
class Row:
    """Summary statistics of one command's samples, and its median relative to the baseline's."""

    name: str
    runs: int
    min: float
    median: float
    max: float
    ratio: float
    """This command's median divided by the baseline's median (1.0 for the baseline itself)."""


@dataclass(frozen=True)
class Command:
    """One compared command: a display name and the argv that runs it."""

    name: str
    argv: list[str]


def summarize(samples: dict[str, list[float]], baseline: str) -> list[Row]:
    """Min, median and max of each command's samples, and the ratio of its median to the baseline's.

    Rows come in the order of ``samples``. Raises ``ValueError`` when ``baseline`` is not one of the
    commands, when a command has no samples, or when the baseline's median is not positive.
    """
    if baseline not in samples:
        raise ValueError(f"baseline {baseline!r} is not among the commands: {', '.join(samples)}")
    empty = [name for name, values in samples.items() if not values]
    if empty:
        raise ValueError(f"no samples for: {', '.join(empty)}")
    base = statistics.median(samples[baseline])
    if base <= 0:
        raise ValueError(f"baseline {baseline!r} has a non-positive median ({base})")
    return [Row(name=name, runs=len(values), min=min(values), median=statistics.median(values),
                max=max(values), ratio=statistics.median(values) / base)
            for name, values in samples.items()]


def markdown_table(rows: Sequence[Row], *, unit: str = "ms", scale: float = 1e3,
                   digits: int = 3) -> str:
    """A Markdown table ``name | runs | min | median | max | ratio to baseline``.

    Values are multiplied by ``scale`` and shown with ``digits`` decimals and ``unit`` (the default
    shows seconds as milliseconds). The table ends with a newline.
    """
    head = f"| name | runs | min ({unit}) | median ({unit}) | max ({unit}) | ratio to baseline |"
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        cells = [f"{value * scale:.{digits}f}" for value in (row.min, row.median, row.max)]
        lines.append(f"| {row.name} | {row.runs} | {' | '.join(cells)} | {row.ratio:.3f} |")
    return "\n".join(lines) + "\n"


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    for line in text.splitlines():
        if line.lower().startswith(("model name", "hardware", "cpu model")):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def machine_record() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, OS, Python and package versions, load.

    Keys: ``cpu``, ``cores``, ``os``, ``python``, one per installed package of :data:`PACKAGES`
    (read from package metadata, never by importing the package), and ``loadavg`` (the 1, 5 and
    15 minute load averages, where the OS has them).
    """
    record: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count() or 0,
        "os": platform.platform(),
        "python": platform.python_version(),
    }
    for name in PACKAGES:
        version = _version(name)
        if version is not None:
            record[name] = version
    if hasattr(os, "getloadavg"):
        # The machine may be shared: the load when the benchmark started says how busy it was.
        record["loadavg"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return record


def markdown_section(title: str, command_line: str, machine: Mapping[str, Any], rows: Sequence[Row],
                     notes: Sequence[str] = (), *, date: str | None = None, unit: str = "ms",
                     scale: float = 1e3, digits: int = 3, caption: str = "",
                     tables: Sequence[tuple[str, Sequence[Row]]] = ()) -> str:
    """A dated Markdown section: title, the command that reproduces it, the machine, the table, notes.

    ``caption``, when given, is a line above the table. ``tables`` are further ``(caption, rows)``
    tables, in the same unit, that follow the first one: other measures of the same runs.
    """
    date = date or _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    machine_text = "; ".join(f"{key}: {value}" for key, value in machine.items())
    parts = [f"## {title}", "", f"Date: {date}", "", "Reproduce (from the repository root):", "",
             "```", command_line, "```", "", f"Machine: {machine_text}.", ""]
    for text, table_rows in ((caption, rows), *tables):
        if text:
            parts += [text, ""]
        parts += [markdown_table(table_rows, unit=unit, scale=scale, digits=digits).rstrip("\n"), ""]
    parts.pop()  # the blank line after the last table; the notes add their own
    if notes:
        parts += [""] + [f"- {note}" for note in notes]
    return "\n".join(parts) + "\n"


def append_markdown(path: Path, section: str, header: str) -> None:
    """Appends ``section`` to ``path``, creating the file with ``header`` first when it is missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = path.read_text() if path.exists() else header.rstrip("\n") + "\n"
    path.write_text(existing.rstrip("\n") + "\n\n" + section)


def parse_measurement(stdout: str, key: str) -> dict[str, Any]:
    """The last JSON object in ``stdout`` that holds ``key``, one object per line.

    A launcher's rank tag in front of the object is ignored, and so is text after it: Open MPI's
    output tagging can glue the next line's tag onto the end. Raises ``ValueError`` if no line fits.
    """
    decoder = json.JSONDecoder()
    for line in reversed(stdout.splitlines()):
        text = _RANK_TAG.sub("", line.strip(), count=1).strip()
        if not text.startswith("{"):
            continue
        try:
            obj, _ = decoder.raw_decode(text)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and key in obj:
            return obj
    raise ValueError(f"no JSON line with key {key!r} in the output")


def round_order(commands: Sequence[Command], round_index: int) -> list[Command]:
    """The commands' order in round ``round_index``: as given on even rounds, reversed on odd ones."""
    return list(commands) if round_index % 2 == 0 else list(reversed(commands))


def run_once(command: Command, key: str, *, env: Mapping[str, str] | None = None,
             timeout: float | None = None) -> dict[str, Any]:
    """Runs one command and returns its measurement; raises :class:`BenchError` on any failure."""
    try:
        proc = subprocess.run(command.argv, capture_output=True, text=True, timeout=timeout,
                              env=None if env is None else dict(env))
    except subprocess.TimeoutExpired:
        raise BenchError(f"{command.name}: no result within {timeout} s") from None
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
    if proc.returncode != 0:
        raise BenchError(f"{command.name}: exit code {proc.returncode}\n{tail}")
    try:
        return parse_measurement(proc.stdout, key)
    except ValueError as exc:
        raise BenchError(f"{command.name}: {exc}\n{tail}") from None


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run_interleaved(commands: Sequence[Command], rounds: int, key: str, *, warmup_rounds: int = 0,
                    env: Mapping[str, str] | None = None, timeout: float | None = None,
                    log: Callable[[str], None] = _log) -> dict[str, list[dict[str, Any]]]:
    """Runs every command once per round, interleaved, and returns each command's measurements.

    ``warmup_rounds`` extra rounds run first and are discarded: the first runs after a pause pay
    for cold file caches. Progress goes to ``log``. Command names must be unique.
    """
    names = [c.name for c in commands]
    if len(set(names)) != len(names):
        raise ValueError(f"command names must be unique: {names}")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for index in range(-warmup_rounds, rounds):
        label = "warm-up" if index < 0 else f"round {index + 1}/{rounds}"
        for command in round_order(commands, index):
            started = time.perf_counter()
            measurement = run_once(command, key, env=env, timeout=timeout)
            log(f"{label} {command.name}: {key}={measurement[key]:.6g} "
                f"({time.perf_counter() - started:.1f} s)")
            if index >= 0:
                results[command.name].append(measurement)
    return results


def samples_of(results: Mapping[str, list[dict[str, Any]]], key: str) -> dict[str, list[float]]:
    """The values of ``key`` from :func:`run_interleaved`'s measurements, per command."""
    return {name: [float(m[key]) for m in runs] for name, runs in results.items()}
