"""A user's own PyTorch loop in elastic mode (``@trainer.elastic``), run by
tests/multirank/test_own_loop_elastic.py under elastic ``horovodrun`` and by
tests/torch/test_own_loop.py in one process.

``own_loop_elastic_worker.py [overrides...]`` trains digits with a pause per step (so that a test
can kill a worker mid-epoch); rank 0 writes ``<log.dir>/loop.json``: the position and the world
size at the end.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.data.digits import DigitsDataset
from hvdtrain.torch import Trainer

PAUSE_S = 0.05


class Digits(torch.utils.data.Dataset):
    """The digits' training split as tensors."""

    def __init__(self) -> None:
        split = DigitsDataset().train()
        self.x = torch.tensor(split.x, dtype=torch.float32)
        self.y = torch.tensor(split.y, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def main(overrides: list[str], pause: float = PAUSE_S) -> Trainer:
    trainer = Trainer(None, overrides)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model, optimizer = trainer.setup(model)  # the config's optimizer: its LR follows the size
    loader = trainer.dataloader(Digits(), num_workers=0)

    @trainer.elastic
    def train() -> None:
        for epoch in trainer.epochs():
            loader.sampler.set_epoch(epoch)
            total, count = 0.0, 0
            for x, y in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                trainer.backward(loss)
                optimizer.step()
                if len(y):
                    total, count = total + loss.item() * len(y), count + len(y)
                time.sleep(pause)
            trainer.log({"loss": total, "count": count})

    train()
    trainer.close()
    if trainer.rank == 0:
        Path(trainer.cfg.run_dir, "loop.json").write_text(json.dumps(
            {"step": trainer.position.step, "epoch": trainer.position.epoch,
             "samples": trainer.position.samples, "size": trainer.size}))
    return trainer


if __name__ == "__main__":
    main(sys.argv[1:])
