"""The measured side of the benchmarks: hvdtrain's PyTorch or TensorFlow trainer on the bench problem.

Loads ``configs/digits_torch.yaml`` or ``configs/digits_tf.yaml`` with overrides that make the run do
the same work as ``handwritten_torch.py`` / ``handwritten_tf.py`` (the settings of
:mod:`workload`, a constant learning rate ``0.05 x size``, no warm-up, one evaluation and one
checkpoint at the end), and keeps what hvdtrain always does (metrics averaged over ranks and written
to ``metrics.jsonl`` every ``log.every_steps``, atomic checkpoint), since that is its overhead. The
two frameworks get the same overrides, so they also run the same work as each other.

Run under ``horovodrun -np 2 --gloo python scripts/bench/hvdtrain_worker.py --framework tensorflow
--epochs 10``. Rank 0 prints one JSON line with the hand-written workers' keys (``steps``,
``wall_time_s``, ``step_time_s``, ``eval_loss``, ``eval_accuracy``; the wall time covers the loop from
the first step through the final evaluation and checkpoint) and three more for ``frameworks.py``:
``samples``, ``samples_per_s`` (samples over that wall time) and ``steady_samples_per_s`` (see
:func:`steady_samples_per_s`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# Run from a checkout, the worker must find this checkout's hvdtrain even if none is installed.
sys.path.insert(0, str(ROOT))

import workload  # noqa: E402
from hvdtrain.config import load_config  # noqa: E402
from hvdtrain.trainer import train  # noqa: E402
from workload import BASE_LR, BATCH_SIZE, EVAL_BATCH_SIZE, HIDDEN, MOMENTUM, SEED  # noqa: E402

CONFIGS = {"torch": ROOT / "configs" / "digits_torch.yaml",
           "tensorflow": ROOT / "configs" / "digits_tf.yaml"}
SKIP_EPOCHS = 1
"""Epochs left out of the steady state: they hold TensorFlow's trace and both sides' first touches."""


def overrides(framework: str, epochs: int, log_dir: str) -> list[str]:
    """Config overrides that pin every setting the hand-written loops hard-code."""
    return [
        f"framework={framework}", "model.name=mlp", f"model.options.hidden=[{HIDDEN}]",
        "data.name=digits", f"train.epochs={epochs}", "train.max_steps=0", "train.threads=0",
        "train.backward_passes_per_step=1",
        # The hand-written loops evaluate once, after the last epoch.
        f"train.eval_every_epochs={epochs}",
        f"seed={SEED}", f"data.batch_size={BATCH_SIZE}", f"data.eval_batch_size={EVAL_BATCH_SIZE}",
        "data.shuffle=true", "optim.name=sgd", f"optim.lr={BASE_LR}", "optim.scale_lr=true",
        f"optim.momentum={MOMENTUM}", "optim.weight_decay=0", "optim.warmup_steps=0",
        "optim.schedule=constant", "comm.compression=none",
        # One checkpoint, at the end, like the hand-written save.
        "checkpoint.enabled=true", "checkpoint.every_steps=0",
        "log.console=false", "log.overwrite=true", f"log.dir={log_dir}",
    ]


def windows(records: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """``(epoch, samples, seconds)`` of each logged window, from ``metrics.jsonl``'s records.

    A record holds its window's ``samples_per_sec`` and ``step_time_s`` (seconds per step); the
    window's steps are the distance to the previous record's ``step``. Records that hold an
    evaluation are left out: their window's time includes it.
    """
    out, previous = [], 0
    for record in records:
        steps, previous = record["step"] - previous, record["step"]
        seconds = record["step_time_s"] * steps
        if not any(key.startswith("eval_") for key in record):
            out.append((record["epoch"], record["samples_per_sec"] * seconds, seconds))
    return out


def steady_samples_per_s(metrics_path: Path, skip_epochs: int = SKIP_EPOCHS) -> float | None:
    """Samples per second of rank 0's training windows after the first ``skip_epochs`` epochs.

    No ``tf.function`` trace, evaluation or checkpoint falls in those windows; each window's metric
    allreduce does, as it is part of every step's cost. ``None`` when no window is left (a run of
    ``skip_epochs`` epochs or fewer).
    """
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    kept = [(samples, seconds) for epoch, samples, seconds in windows(records) if epoch >= skip_epochs]
    seconds = sum(s for _, s in kept)
    return sum(n for n, _ in kept) / seconds if seconds > 0 else None


def main() -> None:
    """Parses the arguments, trains with hvdtrain, and prints the measurement on rank 0."""
    parser = workload.worker_parser(__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=sorted(CONFIGS), default="torch")
    args = parser.parse_args()
    log_dir = str(workload.out_dir(args.out_dir, "hvdtrain-bench-"))

    # environ={}: HVDTRAIN_* variables of the caller must not change what is measured.
    cfg = load_config(CONFIGS[args.framework], overrides(args.framework, args.epochs, log_dir),
                      environ={})
    result = train(cfg)

    if result.engine.rank == 0:
        summary = result.summary
        wall, samples = summary["wall_time_s"], summary["samples"]
        workload.report(workload.measurement(
            summary["steps"], wall, summary["final"].get("eval_loss"),
            summary["final"].get("eval_accuracy"), samples=samples, samples_per_s=samples / wall,
            steady_samples_per_s=steady_samples_per_s(result.run_dir / "metrics.jsonl")))


if __name__ == "__main__":
    main()
