"""``ring``: Horovod's allreduce among all ranks, dense or compressing (``comm.topology=ring``,
``comm.compression``). It composes with every setting; parameter servers are the other value of
the same key."""

from __future__ import annotations

from hvdtrain.strategies.base import Strategy

STRATEGY = Strategy(
    name="ring",
    summary="Horovod's allreduce among all ranks, dense or compressing "
            "(`comm.topology=ring`, `comm.compression`)",
    active=lambda cfg: cfg.comm.topology == "ring" and cfg.shard.stage == 0,
    engines={"torch": "hvdtrain.torch.engine:TorchEngine",
             "tensorflow": "hvdtrain.tensorflow.engine:TensorFlowEngine"},
    alternatives={"ps": "the other value of comm.topology"},
)
