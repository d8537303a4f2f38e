"""A small benchmark harness: interleaved runs, medians, ratios, an A/A control, a Markdown record.

The compared variants run inside one job (``interleaved.py`` under ``horovodrun``), in rounds, one
run of each per round, so that a slow period of a shared machine hits every variant alike rather
than whichever ran during it, and so that all of them share the same processes, the same pairing
of ranks and the same scheduling: separate jobs differ by far more than the overheads measured
here, depending on where the OS happens to place each job's processes. The order within a round is
reversed on every other round (A B A' / A' B A), so that no variant always follows the same
neighbour. The first variant is the baseline, and a second copy of it (the A/A control) shows how
far two identical variants disagree: a ratio is only meaningful when it differs from 1 by more than
the control does.

Rank 0 of the job prints one JSON object per run on a line of its stdout (possibly behind a
launcher's ``[rank]<stdout>:`` tag). Everything here is pure except :func:`machine_record`, which
only reads files and package metadata. The harness imports no framework, so it measures nothing by
accident and loads in milliseconds.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import statistics
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

PACKAGES = ("torch", "horovod", "tensorflow", "tensorflow-cpu", "numpy")
"""Distributions whose versions :func:`machine_record` reports (when installed)."""

# Launchers tag each worker line with its rank: Gloo as "[0]<stdout>:", Open MPI as "[1,0]<stdout>:".
_RANK_TAG = re.compile(r"^\[[\d,]+\]<\w+>:")


class BenchError(RuntimeError):
    """A benchmark job failed or printed fewer measurements than it should have."""


@dataclass(frozen=True)
class Row:
    """Summary statistics of one variant's samples, and its median relative to the baseline's."""

    name: str
    runs: int
    min: float
    median: float
    max: float
    ratio: float
    """This variant's median divided by the baseline's median (1.0 for the baseline itself)."""


def summarize(samples: dict[str, list[float]], baseline: str) -> list[Row]:
    """Min, median and max of each variant's samples, and the ratio of its median to the baseline's.

    Rows come in the order of ``samples``. Raises ``ValueError`` when ``baseline`` is not one of the
    variants, when a variant has no samples, or when the baseline's median is not positive.
    """
    if baseline not in samples:
        raise ValueError(f"baseline {baseline!r} is not among the variants: {', '.join(samples)}")
    empty = [name for name, values in samples.items() if not values]
    if empty:
        raise ValueError(f"no samples for: {', '.join(empty)}")
    base = statistics.median(samples[baseline])
    if base <= 0:
        raise ValueError(f"baseline {baseline!r} has a non-positive median ({base})")
    return [Row(name=name, runs=len(values), min=min(values), median=statistics.median(values),
                max=max(values), ratio=statistics.median(values) / base)
            for name, values in samples.items()]


def judge(met: bool, control: float, tolerance: float = 0.10) -> str:
    """``met`` or ``missed``, or ``inconclusive`` when the A/A control's ratio is farther than
    ``tolerance`` from 1: a machine that noisy cannot tell a target met from missed."""
    if abs(control - 1.0) > tolerance:
        return (f"inconclusive (would be {'met' if met else 'missed'}, but the A/A control is off "
                f"by more than {tolerance:.0%})")
    return "met" if met else "missed"


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


def markdown_grid(header: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    """A Markdown table of preformatted ``cells`` under ``header``: first column left-aligned, the
    others right-aligned. It ends with a newline."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def section_text(title: str, command_line: str, machine: Mapping[str, Any],
                 blocks: Sequence[str], notes: Sequence[str] = (), *,
                 date: str | None = None) -> str:
    """A dated Markdown section: title, the command that reproduces it, the machine, ``blocks``
    (tables with their captions, each a finished piece of Markdown), then the notes as a list."""
    date = date or _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    machine_text = "; ".join(f"{key}: {value}" for key, value in machine.items())
    parts = [f"## {title}", "", f"Date: {date}", "", "Reproduce (from the repository root):", "",
             "```", command_line, "```", "", f"Machine: {machine_text}.", ""]
    for block in blocks:
        parts += [block.rstrip("\n"), ""]
    parts.pop()  # the blank line after the last block; the notes add their own
    if notes:
        parts += [""] + [f"- {note}" for note in notes]
    return "\n".join(parts) + "\n"


def markdown_section(title: str, command_line: str, machine: Mapping[str, Any], rows: Sequence[Row],
                     notes: Sequence[str] = (), *, date: str | None = None, unit: str = "ms",
                     scale: float = 1e3, digits: int = 3, caption: str = "",
                     tables: Sequence[tuple[str, Sequence[Row]]] = ()) -> str:
    """:func:`section_text` with tables of :class:`Row`: ``rows`` under ``caption`` (a line above
    the table, when given), then further ``(caption, rows)`` tables, in the same unit, that follow
    the first one: other measures of the same runs.
    """
    blocks = []
    for text, table_rows in ((caption, rows), *tables):
        table = markdown_table(table_rows, unit=unit, scale=scale, digits=digits)
        blocks.append(f"{text}\n\n{table}" if text else table)
    return section_text(title, command_line, machine, blocks, notes, date=date)


def put_section(path: Path, section: str, header: str) -> None:
    """Puts ``section`` into the Markdown file ``path``: in place of the section with the same
    ``## `` heading (its first line) when there is one, so a rerun replaces its stale table and any
    older copies go, else at the end. Creates the file with ``header`` first when it is missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = path.read_text() if path.exists() else header.rstrip("\n") + "\n"
    heading = section.lstrip("\n").splitlines()[0]
    # Split before every second-level heading: part 0 is the header, each other part one section.
    parts = re.split(r"(?m)^(?=## )", existing)
    same = [i for i, part in enumerate(parts) if part.splitlines()[0:1] == [heading]]
    if not same:
        path.write_text(existing.rstrip("\n") + "\n\n" + section)
        return
    parts[same[0]] = section.rstrip("\n") + "\n\n"
    kept = [part for i, part in enumerate(parts) if i not in same[1:]]
    path.write_text("".join(kept).rstrip("\n") + "\n")


def parse_measurements(output: str, key: str) -> list[dict[str, Any]]:
    """Every JSON object in ``output`` that holds ``key``, one object per line, in order.

    A launcher's rank tag in front of an object is ignored, and so is text after it: Open MPI's
    output tagging can glue the next line's tag onto the end. Other lines are skipped.
    """
    decoder = json.JSONDecoder()
    found = []
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


T = TypeVar("T")


def round_order(items: Sequence[T], round_index: int) -> list[T]:
    """The variants' order in round ``round_index``: as given on even rounds, reversed on odd ones.

    Warm-up rounds have negative indices and follow the same rule.
    """
    return list(items) if round_index % 2 == 0 else list(reversed(items))


def group_runs(records: Sequence[Mapping[str, Any]], names: Sequence[str],
               rounds: int) -> dict[str, list[dict[str, Any]]]:
    """The measured runs of each variant, by table name, from one job's per-run records.

    Each record holds ``slot`` (the variant's index in ``names``) and ``round`` (negative for a
    discarded warm-up round). Raises :class:`BenchError` unless every slot has exactly ``rounds``
    measured runs: a job that died half-way must not pass for a shorter benchmark.
    """
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    if len(results) != len(names):
        raise ValueError(f"variant names must be unique: {list(names)}")
    for record in records:
        if record["round"] >= 0:
            results[names[record["slot"]]].append(dict(record))
    short = [f"{name} ({len(runs)})" for name, runs in results.items() if len(runs) != rounds]
    if short:
        raise BenchError(f"expected {rounds} measured runs of every variant, got: "
                         f"{', '.join(short)}")
    return results


def samples_of(results: Mapping[str, list[dict[str, Any]]], key: str) -> dict[str, list[float]]:
    """The values of ``key`` from :func:`group_runs`'s measurements, per variant."""
    return {name: [float(m[key]) for m in runs] for name, runs in results.items()}
