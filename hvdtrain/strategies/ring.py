"""``ring``: Horovod's allreduce among all ranks, dense or compressing (``comm.topology=ring``,
``comm.compression``). It composes with every setting; parameter servers are the other value of
the same key."""

from __future__ import annotations

from hvdtrain.strategies.base import DENSE, WHOLE, CheckpointLayout, ExchangeKind, Strategy, always

EXCHANGES = (
    ExchangeKind("dense", lambda cfg: cfg.comm.compression in DENSE, {
        "torch": "hvdtrain.torch.exchange:dense_exchange",
        "tensorflow": "hvdtrain.tensorflow.exchange:dense_exchange",
        "torch.stage": "hvdtrain.torch.stages:stage_allreduce",
        "tensorflow.stage": "hvdtrain.tensorflow.pipeline:stage_exchange"}),
    ExchangeKind("compressing", always, {
        "torch": "hvdtrain.torch.exchange:compressing_exchange",
        "tensorflow": "hvdtrain.tensorflow.exchange:compressing_exchange",
        "torch.stage": "hvdtrain.torch.stages:stage_compressing",
        "tensorflow.stage": "hvdtrain.tensorflow.pipeline:stage_exchange"}),
)
"""``dense``: Horovod's own allreduce carries every tensor (``none``, ``fp16``); ``compressing``:
a method's plan run with the framework's kernels (:mod:`hvdtrain.compression.exchange`). A
pipeline stage runs the same kinds among its copies (the ``.stage`` roles)."""

STRATEGY = Strategy(
    name="ring",
    summary="Horovod's allreduce among all ranks, dense or compressing "
            "(`comm.topology=ring`, `comm.compression`)",
    active=lambda cfg: cfg.comm.topology == "ring" and cfg.shard.stage == 0,
    engines={"torch": "hvdtrain.torch.engine:TorchEngine",
             "tensorflow": "hvdtrain.tensorflow.engine:TensorFlowEngine"},
    exchanges=EXCHANGES,
    checkpoint=CheckpointLayout(WHOLE, "rank 0", "every rank's compression residuals", True),
    cost="hvdtrain.plan.predict:rings",
    alternatives={"ps": "the other value of comm.topology"},
)
