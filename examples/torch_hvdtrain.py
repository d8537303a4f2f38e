"""A PyTorch training script as a Horovod user writes it: run it with
`horovodrun -np 2 python examples/torch_hvdtrain.py OUT_DIR [key=value ...]`.

An MLP on scikit-learn's digits (shipped with the package, no download). `DistributedSampler`
shards the data, `hvd.DistributedOptimizer` averages the gradients, the broadcasts start every
rank from rank 0's state, and only rank 0 saves. This is examples/torch_horovod.py on hvdtrain
(`diff examples/torch_horovod.py examples/torch_hvdtrain.py`): hvdtrain's global batches, its
checkpoints (resume with checkpoint.resume=auto), stop signals and metric sinks.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from hvdtrain.torch import Trainer


def digits() -> torch.utils.data.Dataset:
    """The 1,797 digits, pixels scaled to [0, 1]."""
    x, y = load_digits(return_X_y=True)
    return torch.utils.data.TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32),
                                          torch.tensor(y))


def main(out: Path) -> None:
    trainer = Trainer(None, ["train.epochs=3", f"log.dir={out}", *sys.argv[2:]])
    dataset = digits()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * trainer.size, momentum=0.9)
    model, optimizer = trainer.setup(model, optimizer)
    loader = trainer.dataloader(dataset)

    losses = []
    for epoch in trainer.epochs():
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total, count = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            trainer.backward(loss)
            optimizer.step()
            total, count = total + float(loss) * len(y), count + len(y)
        losses.append(trainer.log({"loss": total, "count": count})["loss"])

    trainer.save()
    trainer.close()
    checksum = float(sum(p.abs().sum() for p in model.parameters()))
    print(json.dumps({"rank": trainer.rank, "loss": losses, "checksum": checksum}), flush=True)


if __name__ == "__main__":  # loader workers may start by importing this file: train only here
    main(Path(sys.argv[1]))
