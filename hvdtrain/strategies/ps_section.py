"""The ``ps`` section's own values: what the parameter-server strategy
(:mod:`hvdtrain.strategies.ps`) refuses in its section, beside its row of the compatibility table,
so that :mod:`hvdtrain.config` checks the section without importing :mod:`hvdtrain.ps`.

Feature-free: it reads the config's dataclasses (typed ``Any``) and imports only the checks'
helpers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hvdtrain.configcheck import refuse_unread
from hvdtrain.errors import ConfigError


def check_ps(ps: Any) -> None:
    """The ``ps`` section's own values that cannot run, as one-line errors (what it does not
    compose with is in the compatibility table, :mod:`hvdtrain.strategies.table`; what only the
    launch can tell, such as the controller and the number of ranks, is checked by the layout of
    ranks, :class:`hvdtrain.layout.Layout`, and :mod:`hvdtrain.ps.mpi`)."""
    if ps.staleness and ps.consistency != "ssp":
        raise ConfigError(f"ps.staleness={ps.staleness}: only ps.consistency=ssp has a staleness "
                          f"bound (ps.consistency={ps.consistency!r}); leave it 0")


PS_OVERLAP_READ = ("ps.overlap is read by dedicated servers under bsp with PyTorch and "
                   "comm.compression none or fp16 only")
"""Where ``ps.overlap`` takes effect (:class:`hvdtrain.torch.ps.TorchPSExchange` streams a dense
push; TensorFlow, the servers' optimizer and the sharded update push after the pass)."""


def check_ps_unread(cfg: Any) -> None:
    """The ``ps`` settings that would do nothing in ``cfg`` (a :class:`hvdtrain.config.Config`),
    as one-line errors: any of them on the ring, ``ps.overlap`` outside the combination that
    streams the push."""
    ps, topology = cfg.ps, cfg.comm.topology
    if topology != "ps":
        refuse_unread("ps.", ps, [f.name for f in dataclasses.fields(ps)],
                      f"comm.topology={topology!r}", "only parameter servers read the ps "
                      "section", "comm.topology=ps")
        return
    misfit = [(ps.consistency != "bsp", f"ps.consistency={ps.consistency!r}"),
              (cfg.framework != "torch", f"framework={cfg.framework!r}"),
              (cfg.comm.compression not in ("none", "fp16"),
               f"comm.compression={cfg.comm.compression!r}")]
    for bad, given in misfit:
        if bad:
            refuse_unread("ps.", ps, ["overlap"], given, PS_OVERLAP_READ)
