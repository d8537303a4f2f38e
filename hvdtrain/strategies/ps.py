"""``ps``: dedicated parameter servers beside the workers (``comm.topology=ps``,
docs/parameter-servers.md). Its row of the compatibility table; the checks of its own values
(``ps.staleness``, the unread ``ps`` keys) stay with its config section."""

from __future__ import annotations

from typing import Any

from hvdtrain.strategies.base import (
    DENSE,
    SPARSE,
    WHOLE,
    CheckpointLayout,
    ExchangeKind,
    Rule,
    Strategy,
    always,
)

PS = {"comm.topology": "ps"}


def _on(cfg: Any) -> bool:
    return cfg.comm.topology == "ps"


def _async(cfg: Any) -> bool:
    """The servers run the optimizer (``ssp``, ``asp``)."""
    return _on(cfg) and cfg.ps.consistency != "bsp"


def _method(cfg: Any) -> str:
    return f"comm.compression={cfg.comm.compression!r} with comm.topology=ps"


RULES = (
    Rule("ps", "elastic", lambda cfg: _on(cfg) and cfg.elastic.enabled,
         lambda cfg: "comm.topology=ps: elastic mode cannot run with parameter servers (elastic "
                     "Horovod needs Gloo, the servers need MPI); set elastic.enabled=false or "
                     "comm.topology=ring",
         {**PS, "elastic.enabled": True}),
    Rule("ps", "powersgd",
         lambda cfg: _on(cfg) and cfg.comm.compression not in (*DENSE, *SPARSE),
         lambda cfg: f"{_method(cfg)}: PowerSGD's factors need two averaging rounds and one "
                     "orthogonalisation a step, which servers that only sum do not run; use "
                     "topk, randomk or qsgd, or comm.topology=ring",
         {**PS, "comm.compression": "powersgd"}),
    Rule("ps", "sparse compression",
         lambda cfg: _async(cfg) and cfg.comm.compression in SPARSE,
         lambda cfg: f"{_method(cfg)} and ps.consistency={cfg.ps.consistency!r}: the servers' "
                     "optimizer takes dense pushes only; use bsp, or none or fp16",
         {**PS, "ps.consistency": "asp", "comm.compression": "topk"}, only="under ssp or asp"),
)
"""Checked before the sharded update's rules."""

ASYNC_RULES = (
    Rule("ps", "tensorflow", lambda cfg: _async(cfg) and cfg.framework != "torch",
         lambda cfg: f"ps.consistency={cfg.ps.consistency!r}: the servers' optimizer serves "
                     "PyTorch workers only; use framework=torch or ps.consistency=bsp",
         {**PS, "ps.consistency": "asp", "framework": "tensorflow"}, only="under ssp or asp"),
    Rule("ps", "fp16", lambda cfg: _async(cfg) and cfg.train.precision == "fp16",
         lambda cfg: f"ps.consistency={cfg.ps.consistency!r} with train.precision='fp16': a push "
                     "is applied alone, with no loss scaler between ranks; use fp32 or bf16",
         {**PS, "ps.consistency": "asp", "train.precision": "fp16"}, only="under ssp or asp"),
)
"""The servers' optimizer (``ssp``, ``asp``) with what cannot run beside it; checked after the
sharded update's rules."""

STRATEGY = Strategy(
    name="ps",
    summary="dedicated parameter servers beside the workers, bsp, ssp or asp "
            "(`comm.topology=ps`)",
    active=_on,
    rules=RULES + ASYNC_RULES,
    exchanges=(
        ExchangeKind("ps", lambda cfg: cfg.ps.consistency == "bsp", {
            "torch": "hvdtrain.torch.exchange:ps_exchange",
            "tensorflow": "hvdtrain.tensorflow.exchange:ps_exchange"}),
        # TensorFlow has none: the table refuses ssp and asp with it (ps x tensorflow).
        ExchangeKind("ps-optimizer", always, {
            "torch": "hvdtrain.torch.exchange:server_optimizer_exchange"}),
    ),
    checkpoint=CheckpointLayout(WHOLE, "rank 0", "the servers' pull residuals and, under ssp "
                                "or asp, their optimizer state, as whole flat vectors", True),
    cost="hvdtrain.plan.predict:servers",
    alternatives={"ring": "the other value of comm.topology"},
)
