"""The measured side of the overhead benchmark: hvdtrain's PyTorch trainer on the hand-written problem.

Loads ``configs/digits_torch.yaml`` with overrides that make the run do the same work as
``handwritten_torch.py`` (constant learning rate ``0.05 x size``, no warm-up, one evaluation and one
checkpoint at the end), and keeps what hvdtrain always does (metrics averaged over ranks and written
to ``metrics.jsonl`` every ``log.every_steps``, atomic checkpoint), since that is its overhead.

Run under ``horovodrun -np 2 --gloo python scripts/bench/hvdtrain_torch.py --epochs 10``. Rank 0
prints one JSON line ``{"steps", "wall_time_s", "step_time_s", ...}`` taken from the run summary,
whose wall time covers the loop from the first step through the final evaluation and checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run from a checkout, the worker must find this checkout's hvdtrain even if none is installed.
sys.path.insert(0, str(ROOT))

from hvdtrain.config import load_config  # noqa: E402
from hvdtrain.trainer import train  # noqa: E402

CONFIG = ROOT / "configs" / "digits_torch.yaml"


def overrides(epochs: int, log_dir: str) -> list[str]:
    """Config overrides that pin every setting the hand-written loop hard-codes."""
    return [
        "framework=torch", "model.name=mlp", "model.options.hidden=[128]", "data.name=digits",
        f"train.epochs={epochs}", "train.max_steps=0", "train.threads=0",
        "train.backward_passes_per_step=1",
        # The hand-written loop evaluates once, after the last epoch.
        f"train.eval_every_epochs={epochs}",
        "seed=0", "data.batch_size=32", "data.eval_batch_size=256", "data.shuffle=true",
        "optim.name=sgd", "optim.lr=0.05", "optim.scale_lr=true", "optim.momentum=0.9",
        "optim.weight_decay=0", "optim.warmup_steps=0", "optim.schedule=constant",
        "comm.compression=none",
        # One checkpoint, at the end, like the hand-written torch.save.
        "checkpoint.enabled=true", "checkpoint.every_steps=0",
        "log.console=false", "log.overwrite=true", f"log.dir={log_dir}",
    ]


def main() -> None:
    """Parses the arguments, trains with hvdtrain, and prints the measurement on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out-dir", default="", help="the run directory (default: a temp dir)")
    args = parser.parse_args()
    log_dir = args.out_dir or tempfile.mkdtemp(prefix="hvdtrain-bench-")

    # environ={}: HVDTRAIN_* variables of the caller must not change what is measured.
    result = train(load_config(CONFIG, overrides(args.epochs, log_dir), environ={}))

    if result.engine.rank == 0:
        summary = result.summary
        wall, steps = summary["wall_time_s"], summary["steps"]
        print(json.dumps({"steps": steps, "wall_time_s": wall, "step_time_s": wall / steps,
                          "eval_loss": summary["final"].get("eval_loss"),
                          "eval_accuracy": summary["final"].get("eval_accuracy")}), flush=True)


if __name__ == "__main__":
    main()
