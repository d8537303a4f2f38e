"""Runs one or more hvdtrain trainings on this rank and saves what the tests compare across ranks.

Usage (under horovodrun): worker.py OUT_DIR CONFIG NAME:override,override [NAME:... ...]
For each NAME it trains CONFIG with the overrides (log.dir = OUT_DIR/NAME) and
writes OUT_DIR/NAME/rank<r>.npz (parameters) and OUT_DIR/NAME/rank<r>.json (this rank's own eval
sums, the summary and its final loss scale), so a test can check that ranks agree and that the
summary is their average.
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
        if result.engine is None:  # a parameter server's rank: it trains nothing
            continue
        rank = result.engine.rank
        run_dir.mkdir(parents=True, exist_ok=True)
        np.savez(run_dir / f"rank{rank}.npz", **result.engine.parameters())
        # The loss scale (1 without fp16), where the engine has one.
        scale_of = getattr(getattr(result.engine, "precision", None), "loss_scale", None)
        scale = scale_of() if callable(scale_of) else None
        (run_dir / f"rank{rank}.json").write_text(json.dumps(
            {"local_eval": result.local_eval, "summary": result.summary, "loss_scale": scale}))


if __name__ == "__main__":
    main()
