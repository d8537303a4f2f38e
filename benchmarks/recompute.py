"""Activation checkpointing (``model.activation_checkpointing``): peak memory per rank and step
time, on and off, in both frameworks (issue 57, point 8).

Each framework trains the built-in GPT (``configs/lm_torch.yaml``, ``configs/lm_tf.yaml``) with
long sequences, so that the activations, not the model states, hold most of a rank's memory: 2
ranks (``horovodrun --gloo``), the ring (``shard.stage=0``: recompute is independent of the
sharding), Adam, a few dozen steps. Three jobs a round, interleaved: ``off``, ``on`` and ``off
again`` (the A/A control); one job a setting, so that one run's peak does not carry into the
next. Every rank reports its peak resident memory (``summary.json``'s ``peak_rss_mb``) and its
median step time after the first logging window (``metrics.jsonl``'s ``step_time_s``; the first
window holds TensorFlow's tracing). What recompute trades: less memory for one more forward pass,
so a step costs about 1 + forward / (forward + backward), some 1.3 x.

Usage (from the repository root)::

    .venv/bin/python benchmarks/recompute.py
    .venv/bin/python benchmarks/recompute.py --quick --no-write   # a tiny end-to-end check
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness

sys.path.insert(0, str(harness.ROOT))  # this checkout's hvdtrain, even where none is installed

SIZES = {"rounds": (3, 1), "steps": (40, 12), "width": (256, 64), "layers": (4, 2),
         "seq": (512, 128), "batch": (8, 2)}
CONFIGS = {"torch": "lm_torch.yaml", "tensorflow": "lm_tf.yaml"}
SETTINGS = {"off": False, "on": True, "off again": False}
LOG_EVERY = 10
TIME_TOLERANCE = 0.10
"""A step-time ratio is reported only where the A/A control is within this of 1."""
TITLE = "Activation checkpointing: peak memory per rank and step time, both frameworks"


def worker(out: str, corpus: str, framework: str, recompute: bool, args: list[int]) -> None:
    """Under horovodrun: trains once and prints this rank's record (one JSON line)."""
    from hvdtrain.config import load_config
    from hvdtrain.driver import train
    from hvdtrain.rundir import read_records

    width, layers, seq, batch, steps = args
    cfg = load_config(harness.ROOT / "configs" / CONFIGS[framework], [
        f"data.options.root={corpus}", f"data.options.seq_len={seq}", f"data.batch_size={batch}",
        "data.eval_batch_size=8", f"model.options.d_model={width}",
        f"model.options.layers={layers}", "model.options.heads=4",
        f"model.activation_checkpointing={str(recompute).lower()}", f"train.max_steps={steps}",
        "optim.warmup_steps=0", "checkpoint.enabled=false", "checkpoint.every_steps=0",
        f"log.every_steps={LOG_EVERY}", "log.console=false", "log.wandb=disabled",
        "log.tensorboard=false", f"log.dir={out}", "log.overwrite=true"], environ={})
    result = train(cfg)
    engine = result.engine
    assert engine is not None, "a worker's rank trains"
    times = [r["step_time_s"] for r in read_records(result.run_dir / "metrics.jsonl")
             if "step_time_s" in r and r.get("step", 0) > LOG_EVERY]
    print(json.dumps({"peak_rss_mb": result.summary["peak_rss_mb"][engine.rank],
                      "step_s": statistics.median(times), "rank": engine.rank}), flush=True)


def corpus(tmp: Path) -> Path:
    """The docs corpus (no download): README.md and docs/*.md, byte-level."""
    from hvdtrain.data.text import make_text

    source = tmp / "docs-source.md"
    files = [harness.ROOT / "README.md", *sorted((harness.ROOT / "docs").glob("*.md"))]
    source.write_bytes(b"".join(f.read_bytes() + b"\n" for f in files))
    make_text([source], tmp / "docs", val_fraction=0.01)
    return tmp / "docs"


def measure(args: Any) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Every rank's records by (framework, setting) over the rounds, the settings interleaved
    within a round (:func:`harness.round_order`)."""
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    sizes = [str(v) for v in (args.width, args.layers, args.seq, args.batch, args.steps)]
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-recompute-") as tmp:
        text = corpus(Path(tmp))
        for index in range(args.rounds):
            for framework in args.frameworks:
                for name in harness.round_order(list(SETTINGS), index):
                    harness.log(f"round {index + 1}: {framework} {name}")
                    argv = [harness.horovodrun(), "-np", "2", "--gloo", str(harness.python()),
                            __file__, "--worker", str(Path(tmp) / f"{framework}-{index}"),
                            str(text), framework, str(SETTINGS[name]), *sizes]
                    results.setdefault((framework, name), []).extend(
                        harness.run_job(argv, "peak_rss_mb", args.timeout))
    return results


def rows(results: dict[tuple[str, str], list[dict[str, Any]]], framework: str
         ) -> tuple[list[str], dict[str, float]]:
    """The table's rows of ``framework`` (medians over rounds and ranks) and the ratios against
    ``off``: memory, time, and the A/A control of each."""
    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[(framework, name)])

    ratios = {f"{key} {name}": median(name, key) / median("off", key)
              for key in ("peak_rss_mb", "step_s") for name in ("on", "off again")}
    lines = [f"| {framework} | {name} | {median(name, 'peak_rss_mb'):.0f} | "
             f"{median(name, 'peak_rss_mb') / median('off', 'peak_rss_mb'):.3f} | "
             f"{1e3 * median(name, 'step_s'):.0f} | "
             f"{median(name, 'step_s') / median('off', 'step_s'):.3f} |" for name in SETTINGS]
    return lines, ratios


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the jobs and writes the section (no target: the issue asks that the trade be
    measured)."""
    p = harness.parser("recompute.py", __doc__.splitlines()[0], SIZES)
    p.add_argument("--frameworks", default="torch,tensorflow", help="comma-separated")
    args = harness.parse(p, argv)
    machine = harness.machine_record()
    args.frameworks = args.frameworks.split(",")
    results = measure(args)
    grid = ["| framework | activation checkpointing | peak RSS per rank, MiB | of `off` | "
            "step time, ms | of `off` |", "|---|---|---|---|---|---|"]
    figures = []
    for framework in args.frameworks:
        lines, ratios = rows(results, framework)
        grid += lines
        control = ratios["step_s off again"]
        time = (f"step time {ratios['step_s on']:.2f} x (A/A {control:.2f})"
                if abs(control - 1) <= TIME_TOLERANCE else
                f"step time inconclusive (A/A {control:.2f})")
        figures.append(f"{framework}: memory {ratios['peak_rss_mb on']:.2f} x (A/A "
                       f"{ratios['peak_rss_mb off again']:.2f}), {time}")
    entry = harness.Entry(label="Activation checkpointing, both frameworks", script="recompute.py",
                          verdict="no target; measured: " + "; ".join(figures),
                          figure="peak RSS per rank and step time with recompute on, of off: " +
                          "; ".join(figures),
                          target="none: issue 57 point 8 asks that its memory and time be "
                                 "measured")
    notes = [f"GPT of {args.layers} blocks of width {args.width}, sequences of {args.seq} tokens, "
             f"{args.batch} a rank, 2 ranks over Gloo, Adam, {args.steps} steps a job, "
             f"{args.rounds} round(s) of `off`, `on`, `off again` (order reversed on odd "
             "rounds); medians over rounds and ranks; step time after the first "
             f"{LOG_EVERY} steps."]
    section = harness.section_text(TITLE, args.command, machine, ["\n".join(grid)], notes,
                                   entry=entry)
    harness.publish(section, args)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    if sys.argv[1:2] == ["--worker"]:
        out, text, framework, recompute = sys.argv[2:6]
        worker(out, text, framework, recompute == "True", [int(v) for v in sys.argv[6:11]])
        sys.exit(0)
    sys.exit(main())
