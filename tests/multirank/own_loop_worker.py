"""A user's own PyTorch loop on :class:`hvdtrain.torch.Trainer`, run by tests/multirank/test_own_loop.py
under ``horovodrun -np 2``.

``worker.py OUT CONFIG MODE [overrides...]``; MODE is

- ``equiv``: ``hvdtrain train``'s driver, then the user loop, on the same model, data and config;
  writes each one's parameters (``train-rank<r>.npz``, ``loop-rank<r>.npz``);
- ``loop``: the user loop alone (``loop-rank<r>.npz`` and ``loop-rank<r>.json`` with its
  counter); with ``HVDTRAIN_TEST_SIGNAL_AT=<step>`` each rank sends itself SIGUSR1 after that step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.data.digits import DigitsDataset
from hvdtrain.torch import Trainer


class Counter:
    """A user object with state: the steps this loop has run (resumed from the checkpoint)."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def user_loop(config: str, overrides: list[str]) -> tuple[Trainer, Counter]:
    """The loop a Horovod user writes, on the API: set_epoch, zero_grad, backward, step."""
    trainer = Trainer(config, overrides)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    counter = Counter()
    model, optimizer = trainer.setup(model, counter=counter)
    split = DigitsDataset().train()
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(split.x), torch.from_numpy(split.y))
    loader = trainer.dataloader(dataset, num_workers=0)
    signal_at = int(os.environ.get("HVDTRAIN_TEST_SIGNAL_AT", "0"))
    for epoch in trainer.epochs():
        loader.sampler.set_epoch(epoch)
        sums = {"loss": 0.0, "count": 0.0}
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)  # NaN for a rank's empty micro-batch: ignored
            trainer.backward(loss)
            optimizer.step()
            if len(y):
                sums["loss"] += float(loss) * len(y)
                sums["count"] += len(y)
            if trainer.micro == 0:  # a global batch ended: its step ran
                counter.steps += 1
                if trainer.position.step == signal_at:
                    os.kill(os.getpid(), signal.SIGUSR1)
        trainer.log(sums)  # averaged over the ranks, weighted by count
    trainer.close()
    return trainer, counter


def save(out: Path, name: str, params: dict[str, np.ndarray], rank: int, extra: dict) -> None:
    np.savez(out / f"{name}-rank{rank}.npz", **params)
    (out / f"{name}-rank{rank}.json").write_text(json.dumps(extra))


def main() -> None:
    out, config, mode, *overrides = sys.argv[1:]
    out_dir = Path(out)
    if mode == "equiv":
        from hvdtrain.config import load_config
        from hvdtrain.driver import train

        cfg = load_config(config, [*overrides, f"log.dir={out_dir / 'train'}"])
        result = train(cfg)
        assert result.engine is not None
        save(out_dir, "train", result.engine.parameters(), result.engine.rank, {})
    trainer, counter = user_loop(config, [*overrides, f"log.dir={out_dir / 'loop'}"])
    save(out_dir, "loop", trainer.parameters(), trainer.rank,
         {"counter": counter.steps, "step": trainer.position.step, "epoch": trainer.position.epoch})


if __name__ == "__main__":
    main()
