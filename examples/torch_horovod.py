"""A PyTorch training script as a Horovod user writes it: run it with
`horovodrun -np 2 python examples/torch_horovod.py OUT_DIR`.

An MLP on scikit-learn's digits (shipped with the package, no download). `DistributedSampler`
shards the data, `hvd.DistributedOptimizer` averages the gradients, the broadcasts start every
rank from rank 0's state, and only rank 0 saves. examples/torch_hvdtrain.py is the same script on
hvdtrain (`diff examples/torch_horovod.py examples/torch_hvdtrain.py`). Each rank's last line is
a JSON record of its final loss and a checksum of its weights.
"""

import json
import sys
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn


def digits() -> torch.utils.data.Dataset:
    """The 1,797 digits, pixels scaled to [0, 1]."""
    x, y = load_digits(return_X_y=True)
    return torch.utils.data.TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32),
                                          torch.tensor(y))


def main(out: Path) -> None:
    hvd.init()
    torch.manual_seed(hvd.rank())
    dataset = digits()
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=hvd.size(), rank=hvd.rank())
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=1)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    losses = []
    for epoch in range(3):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total, count = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total, count = total + float(loss) * len(y), count + len(y)
        losses.append(hvd.allreduce(torch.tensor(total / count), name="loss").item())
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {losses[-1]:.4f}", flush=True)

    if hvd.rank() == 0:
        torch.save(model.state_dict(), out / "model.pt")
    checksum = float(sum(p.abs().sum() for p in model.parameters()))
    print(json.dumps({"rank": hvd.rank(), "loss": losses, "checksum": checksum}), flush=True)


if __name__ == "__main__":  # loader workers may start by importing this file: train only here
    main(Path(sys.argv[1]))
