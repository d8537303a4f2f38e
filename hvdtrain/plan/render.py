"""The plan as a ranked console table and as JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from hvdtrain.plan.predict import Plan


def table(result: Plan) -> str:
    """The ranked table: each setting at the most nodes it runs on, then those that do not apply."""
    c = result.cluster
    w = max([34, *(len(p.setting) for p in result.predictions)])
    lines = [f"plan for {result.model} on {c.name or 'the cluster'}: up to {c.nodes} node(s) x "
             f"{c.ranks_per_node} rank(s), batch {result.knobs.batch_size} per rank; one rank alone: "
             f"{result.base_samples_per_s:.1f} samples/s",
             f"{'#':>2}  {'setting':<{w}} {'nodes':>5} {'step ms':>9} {'samples/s':>11} "
             f"{'eff':>6} {'comm ms':>8} {'GiB/rank':>8}  how"]
    rank = 0
    for pred in result.predictions:
        best = pred.best
        if best is None:
            continue
        rank += 1
        mark = "*" if pred.setting == result.configured else " "
        lines.append(f"{rank:>2}{mark} {pred.setting:<{w}} {best.nodes:>5} {1e3 * (best.step_s or 0):>9.2f} "
                     f"{best.samples_per_s or 0:>11.1f} {best.efficiency or 0:>6.1%} "
                     f"{1e3 * (best.comm_s or 0):>8.2f} {_gib(best.memory_gib):>8}  {pred.how}")
    skipped = [p for p in result.predictions if p.best is None]
    if skipped:
        lines.append("not applicable:")
        for pred in skipped:
            # At the most nodes: where a rank needs the least memory.
            why = pred.reason or next((p.reason for p in reversed(pred.points) if p.reason), "")
            mark = "*" if pred.setting == result.configured else " "
            lines.append(f"  {mark} {pred.setting:<{w}} {why}")
    if result.configured:
        lines.append(f"* the config's setting: {result.configured}")
    return "\n".join(lines)


def _gib(memory: float | None) -> str:
    return "-" if memory is None else f"{memory:.2f}"


def as_dict(result: Plan) -> dict[str, Any]:
    """The plan as plain data: inputs, and every setting's points and time-line."""
    return {"model": result.model, "configured": result.configured,
            "cluster": result.cluster.to_dict(),
            "knobs": dataclasses.asdict(result.knobs),
            "base_samples_per_s": result.base_samples_per_s,
            "settings": [dataclasses.asdict(p) for p in result.predictions]}


def write_json(result: Plan, path: str | Path) -> None:
    """Writes :func:`as_dict` to ``path``."""
    Path(path).write_text(json.dumps(as_dict(result), indent=1) + "\n")


def write_plot(result: Plan, path: str | Path) -> None:
    """The scaling curves (samples/s against nodes, one line per setting) as an image."""
    from matplotlib.figure import Figure  # the object API, off-screen, as hvdtrain report draws

    fig = Figure(figsize=(9, 5.5))
    ax = fig.add_subplot()
    for pred in result.predictions:
        pts = [p for p in pred.points if p.samples_per_s is not None]
        if pts:
            ax.plot([p.nodes for p in pts], [p.samples_per_s or 0.0 for p in pts], marker=".",
                    label=pred.setting)
    c = result.cluster
    ax.plot([1, c.nodes], [result.base_samples_per_s * c.ranks_per_node * n for n in (1, c.nodes)],
            "k:", label="linear")
    ax.set_xlabel("nodes")
    ax.set_ylabel("samples/s")
    ax.set_title(f"{result.model}: predicted scaling")
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=110, bbox_inches="tight")
