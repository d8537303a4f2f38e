"""The sharded update (``shard.stage=1``) in one process (Horovod size 1): a model with a
frozen layer trains as the ring does (the shard stepped in place, the trainable parameters' own
flat buffer), and the checkpoint's optimizer state names the parameters as the ring's."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hvdtrain.driver import train
from hvdtrain.torch.shard_files import sources, whole_state
from tests.conftest import CONFIG, quiet_config

SHARDED = ["shard.stage=1", "shard.chunk_kib=1"]


def frozen_first(spec, width: int = 32) -> nn.Module:
    """tiny_net with its first layer frozen: parameters 0 and 1 take no part in the update."""
    net = nn.Sequential(nn.Flatten(), nn.Linear(spec.input_shape[0], width), nn.Tanh(),
                        nn.Linear(width, spec.num_classes))
    for p in net[1].parameters():
        p.requires_grad = False
    return net


def test_a_frozen_layer_stays_and_the_rest_trains_as_the_ring(tmp_path):
    common = ["model.name=tests.torch.test_shard:frozen_first", "model.options={}",
              "train.epochs=1",
              "optim.name=adam", "optim.weight_decay=0.01", "checkpoint.every_steps=20"]
    ring = train(quiet_config(CONFIG, tmp_path / "ring", *common))
    shard = train(quiet_config(CONFIG, tmp_path / "shard", *common, *SHARDED))
    got, want = shard.engine.parameters(), ring.engine.parameters()
    assert got.keys() == want.keys()
    for key in want:  # 256-element pieces: the 330 trainable elements in two rounds
        assert np.array_equal(got[key], want[key]), key
    # The shard the optimizer stepped in place is the trainable parameters' own flat buffer.
    opt = shard.engine.optimizer
    trainable = [p for p in shard.engine.model.parameters() if p.requires_grad]
    assert opt._aliased() and opt.shard.data_ptr() == trainable[0].data_ptr()
    assert opt.shard.numel() == sum(p.numel() for p in trainable) == 330
    paths = [tmp_path / run / "run" / "checkpoints" / "step-00000020.ckpt"
             for run in ("ring", "shard")]
    saved = [torch.load(path, weights_only=True)["optimizer"] for path in paths]
    assert saved[1]["param_groups"] == saved[0]["param_groups"]
    # The shards' state, assembled whole from the rank's part, is the ring's.
    source = sources(torch.load(paths[1], weights_only=True), paths[1], "the shards")
    saved[1] = whole_state(source, shard.engine.model)[1]
    assert saved[1]["state"].keys() == saved[0]["state"].keys() == {2, 3}
    for index, entry in saved[0]["state"].items():
        for key, value in entry.items():
            assert torch.equal(saved[1]["state"][index][key], value), (index, key)
