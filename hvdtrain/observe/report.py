"""``hvdtrain report``: PNG plots and a Markdown summary table from one or more run directories.

Each run directory's ``metrics.jsonl`` gives the curves (one line per run, labelled by its name);
``summary.json`` and ``config.yaml`` give the table. A metric that a run did not log (an older run,
a sink that was off) is left out of that run's lines, and a plot that no run has data for is not
written: missing metrics are skipped, never fatal. Framework-free; matplotlib draws off-screen.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hvdtrain.errors import HvdtrainError
from hvdtrain.rundir import RunDir, read_records


@dataclass(frozen=True)
class Panel:
    """One subplot: ``keys`` of the records drawn against ``x``; a key ending in ``*`` stands for
    every key that starts with the rest (one line per rank for ``cpu_percent_rank*``)."""

    x: str
    keys: tuple[str, ...]
    ylabel: str
    log: bool = False
    """A logarithmic y axis: a first step that traces or warms up costs many times a steady one."""


X_LABELS = {"step": "optimizer step", "time_s": "wall time (s)", "epoch": "epoch"}

# File name -> (title, panels). Keys that no run logged (bytes from an engine without step stats,
# GPU figures without a GPU) simply produce no plot.
FIGURES: dict[str, tuple[str, tuple[Panel, ...]]] = {
    "loss.png": ("Loss", (Panel("step", ("loss", "eval_loss"), "loss"),
                          Panel("time_s", ("loss", "eval_loss"), "loss"))),
    "accuracy.png": ("Accuracy", (Panel("step", ("accuracy", "eval_accuracy"), "accuracy"),
                                  Panel("time_s", ("accuracy", "eval_accuracy"), "accuracy"))),
    "throughput.png": ("Throughput (global)", (Panel("step", ("samples_per_sec",), "samples/s"),)),
    "step_time.png": ("Step time: wall (rank 0), and each rank's own work: median and slowest",
                      (Panel("step", ("step_time_s", "step_time_median_s", "step_time_max_s"),
                             "seconds per step", log=True),)),
    "eval_accuracy.png": ("Evaluation accuracy per epoch",
                          (Panel("epoch", ("eval_accuracy",), "eval accuracy"),)),
    "comm_compute.png": ("Communication vs compute per step",
                         (Panel("step", ("compute_time_s", "comm_time_s", "data_wait_time_s"),
                                "seconds"),)),
    "bytes.png": ("Bytes per step and rank",
                  (Panel("step", ("wire_bytes", "dense_bytes"), "bytes"),)),
    "system.png": ("System, per rank",
                   (Panel("step", ("cpu_percent_rank*",), "CPU (% of one core)"),
                    Panel("step", ("rss_mb_rank*",), "resident memory (MiB)"))),
    "stages.png": ("Pipeline stages: compute, wait for the neighbours, memory; the bubble",
                   (Panel("step", ("stage_compute_s_stage*",), "compute s per step"),
                    Panel("step", ("stage_wait_s_stage*",), "wait s per step"),
                    Panel("step", ("stage_rss_mb_stage*", "stage_gpu_mem_mb_stage*",
                                   "stage_activation_mb_stage*"), "memory, largest copy (MiB)"),
                    Panel("step", ("bubble_fraction",), "bubble fraction"))),
    "gpu.png": ("GPU, per rank", (Panel("step", ("gpu_util_percent_rank*",), "GPU utilisation (%)"),
                                  Panel("step", ("gpu_mem_mb_rank*",), "GPU memory (MiB)"))),
}

# Train curves solid, evaluation (and the second quantity of a panel) dashed, a third dotted.
STYLES = ("-", "--", ":")


@dataclass
class Run:
    """One run directory as the report sees it."""

    path: Path
    label: str
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    config: dict[str, Any]


def load_run(path: Path) -> Run:
    """Reads a run directory; a missing directory or ``metrics.jsonl`` is a user error."""
    if not path.is_dir():
        raise HvdtrainError(f"{str(path)!r} is not a directory")
    run_dir = RunDir(path)
    metrics = run_dir.metrics
    if not metrics.is_file():
        raise HvdtrainError(f"{str(path)!r} holds no {metrics.name} "
                            "(is it a hvdtrain run directory?)")
    records = read_records(metrics)
    summary = _read_optional(run_dir.summary, json.loads)
    config = _read_optional(run_dir.config, yaml.safe_load)
    label = summary.get("name") or config.get("name") or path.name
    return Run(path, str(label), records, summary, config)


def _read_optional(path: Path, parse: Any) -> dict[str, Any]:
    # A run that crashed has no summary.json yet; its curves are still worth plotting.
    if not path.is_file():
        return {}
    data = parse(path.read_text())
    return data if isinstance(data, dict) else {}


def _unique_labels(runs: list[Run]) -> None:
    """Two runs of the same name (say, one per framework) get their directory name appended."""
    names = [run.label for run in runs]
    for run in runs:
        if names.count(run.label) > 1:
            run.label = f"{run.label} ({run.path.name})"


def series(records: list[dict[str, Any]], x: str, key: str) -> tuple[list[float], list[float]]:
    """The (x, y) points of ``key`` over ``x``, from the records that hold both as numbers."""
    points = [(r[x], r[key]) for r in records
              if isinstance(r.get(x), (int, float)) and isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def expand(keys: tuple[str, ...], records: list[dict[str, Any]]) -> list[str]:
    """``keys`` with each ``prefix*`` replaced by the records' keys that start with ``prefix``."""
    out: list[str] = []
    for key in keys:
        if not key.endswith("*"):
            out.append(key)
            continue
        found = {k for r in records for k in r if k.startswith(key[:-1])}
        out += sorted(found, key=lambda k: (len(k), k))  # rank2 before rank10
    return out


def draw_figure(runs: list[Run], title: str, panels: tuple[Panel, ...], out: Path) -> bool:
    """Draws one figure, skipping empty panels; returns whether it had anything to draw."""
    from matplotlib.figure import Figure  # the object API: no pyplot, no global backend state

    drawn = [p for p in panels
             if any(series(r.records, p.x, k)[0] for r in runs for k in expand(p.keys, r.records))]
    if not drawn:
        return False
    fig = Figure(figsize=(6.4 * len(drawn), 4.4), layout="constrained")
    fig.suptitle(title)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for ax, panel in zip(fig.subplots(1, len(drawn), squeeze=False)[0], drawn, strict=True):
        for run, color in zip(runs, colors, strict=True):
            for index, key in enumerate(expand(panel.keys, run.records)):
                style = STYLES[index % len(STYLES)]
                xs, ys = series(run.records, panel.x, key)
                if xs:
                    ax.plot(xs, ys, style, color=color, marker="." if len(xs) < 30 else None,
                            label=f"{run.label}: {key}")
        ax.set_xlabel(X_LABELS.get(panel.x, panel.x))
        if panel.x != "time_s":  # steps and epochs are counts: no 0.5 ticks
            ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel(panel.ylabel)
        if panel.log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(out, dpi=100)
    return True


def _cell(value: Any, digits: int) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value is None else str(value)
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _median(records: list[dict[str, Any]], key: str, scale: float = 1.0) -> float | None:
    values = sorted(r[key] * scale for r in records if isinstance(r.get(key), (int, float)))
    return statistics.median(values) if values else None


def table_row(run: Run) -> list[str]:
    """The summary table's cells for one run; what the run did not record shows as ``-``."""
    last_eval = [r["eval_accuracy"] for r in run.records if r.get("eval_accuracy") is not None]
    final = run.summary.get("final", {}).get("eval_accuracy", last_eval[-1] if last_eval else None)
    steps = run.summary.get("steps", run.records[-1].get("step") if run.records else None)
    compression = run.summary.get("compression", run.config.get("comm", {}).get("compression"))
    stragglers = sorted({e["rank"] for r in run.records for e in r.get("events", [])
                         if e.get("event") == "straggler"})
    return [run.label, _cell(run.summary.get("framework", run.config.get("framework")), 0),
            _cell(compression, 0), _cell(run.summary.get("world_size"), 0), _cell(steps, 0),
            _cell(final, 4), _cell(run.summary.get("samples_per_sec"), 0),
            _cell(run.summary.get("wall_time_s"), 1),
            _cell(_median(run.records, "comm_time_s", 1e3), 2),
            _cell(_median(run.records, "wire_bytes", 2**-10), 1),
            _cell(run.summary.get("compression_ratio"), 1),
            ", ".join(map(str, stragglers)) or "-"]


HEADER = ["run", "framework", "compression", "world size", "steps", "final eval accuracy",
          "samples/s", "wall time (s)", "comm (ms/step)", "wire (KiB/step/rank)",
          "compression ratio", "stragglers"]


def markdown(runs: list[Run], figures: list[str]) -> str:
    """``report.md``: the summary table, then the figures."""
    lines = ["# hvdtrain report", "", "| " + " | ".join(HEADER) + " |",
             "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(table_row(run)) + " |" for run in runs]
    lines += ["", *(f"![{name[:-4]}]({name})" for name in figures)]
    lines += ["", "Runs: " + ", ".join(f"`{run.path}`" for run in runs)]
    return "\n".join(lines) + "\n"


def report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Writes the plots and ``report.md`` for ``run_dirs`` into ``out`` (default: the first run
    directory's ``report/``) and returns the path of ``report.md``."""
    runs = [load_run(Path(path)) for path in run_dirs]
    _unique_labels(runs)
    out = Path(out) if out else RunDir(runs[0].path).report
    out.mkdir(parents=True, exist_ok=True)
    figures = [name for name, (title, panels) in FIGURES.items()
               if draw_figure(runs, title, panels, out / name)]
    (out / "report.md").write_text(markdown(runs, figures))
    return out / "report.md"
