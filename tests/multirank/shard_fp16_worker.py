"""Runs hvdtrain trainings on this rank, as worker.py does, and saves each rank's parameters, its
final loss scale and its count of skipped steps, which the fp16 sharding tests compare across
ranks and against the ring.

Usage (under horovodrun): shard_fp16_worker.py OUT_DIR CONFIG NAME:override,override [NAME:...]
writes OUT_DIR/NAME/rank<r>.npz (parameters) and OUT_DIR/NAME/rank<r>.json (``loss_scale``,
``skipped_steps``, ``steps``).
"""

import json
import sys
from pathlib import Path

import numpy as np

from hvdtrain.config import load_config
from hvdtrain.driver import train


def main() -> None:
    out, config = Path(sys.argv[1]), sys.argv[2]
    for spec in sys.argv[3:]:
        name, _, overrides = spec.partition(":")
        run_dir = out / name
        cfg = load_config(config, [f"log.dir={run_dir}", "log.overwrite=true", "name=" + name,
                                   "log.wandb=disabled", *filter(None, overrides.split(","))])
        result = train(cfg)
        engine = result.engine
        run_dir.mkdir(parents=True, exist_ok=True)
        np.savez(run_dir / f"rank{engine.rank}.npz", **engine.parameters())
        (run_dir / f"rank{engine.rank}.json").write_text(json.dumps({
            "loss_scale": engine.precision.loss_scale(),
            "skipped_steps": result.summary["skipped_steps"],
            "steps": result.summary["steps"]}))


if __name__ == "__main__":
    main()
