"""The update a server runs on its shard with ``ps.consistency=ssp`` or ``asp``, in NumPy, and the
staleness bookkeeping of those modes.

With ``bsp`` the servers only sum and the workers keep their framework optimizers
(:mod:`hvdtrain.ps.server`). With ``ssp``/``asp`` each push is applied on its own as it arrives,
so the optimizer and its state (velocity, Adam's moments) must live where the parameters do: on
the server. The formulas are PyTorch's (``torch.optim.SGD`` with dampening 0 and no Nesterov,
``torch.optim.Adam`` with L2 decay added to the gradient, ``torch.optim.AdamW`` with decoupled
decay), so a worker's ``optim`` section means the same on either side; state is float32 as the
parameters are, the bias corrections are computed in double as PyTorch computes them.

Staleness (Ho et al., 2013, "More effective distributed ML via a stale synchronous parallel
parameter server"): a server counts the updates it applied (its version); a push computed on
parameters pulled at version ``v`` and applied at version ``u`` saw staleness ``u - v``. Under
``ssp`` with bound ``s`` a worker at clock ``c`` (pushes it made) may pull only while the slowest
worker's clock is at least ``c - s``; ``asp`` has no bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

OPTIMIZERS = ("sgd", "adam", "adamw")
"""The ``optim.name`` values a server can run."""


@dataclass
class ShardOptimizer:
    """One server's optimizer over its flat float32 shard ``params`` (updated in place).

    ``lr`` is set by the caller before each :meth:`step` (the workers' schedule travels with the
    push); the rest is the ``optim`` section. ``state`` is what a checkpoint must keep: the
    velocity (SGD) or the two moments (Adam, AdamW), and the number of steps taken.
    """

    name: str
    params: np.ndarray
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    steps: int = 0
    state: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optim.name={self.name!r}: a server runs one of {OPTIMIZERS}")
        if self.params.dtype != np.float32 or not self.params.flags.c_contiguous:
            raise ValueError("a shard's parameters are one contiguous float32 vector")

    def step(self, grad: np.ndarray) -> None:
        """Applies one gradient (float32, the shard's size) to the parameters."""
        p, g = self.params, grad.astype(np.float32, copy=False)
        self.steps += 1
        if self.name == "sgd":
            self._sgd(p, g)
        else:
            self._adam(p, g)

    def _sgd(self, p: np.ndarray, g: np.ndarray) -> None:
        d = g + np.float32(self.weight_decay) * p if self.weight_decay else g
        if self.momentum:
            buf = self.state.get("momentum")
            if buf is None:  # PyTorch's first step: the buffer is the gradient itself
                buf = self.state["momentum"] = np.array(d, np.float32)
            else:
                buf *= np.float32(self.momentum)
                buf += d
            d = buf
        p -= np.float32(self.lr) * d

    def _adam(self, p: np.ndarray, g: np.ndarray) -> None:
        b1, b2 = self.betas
        if self.weight_decay and self.name == "adamw":  # decoupled: shrink before the step
            p *= np.float32(1.0 - self.lr * self.weight_decay)
        elif self.weight_decay:
            g = g + np.float32(self.weight_decay) * p
        m = self.state.setdefault("exp_avg", np.zeros_like(p))
        v = self.state.setdefault("exp_avg_sq", np.zeros_like(p))
        m *= np.float32(b1)
        m += np.float32(1.0 - b1) * g
        v *= np.float32(b2)
        v += np.float32(1.0 - b2) * g * g
        correction1 = 1.0 - b1 ** self.steps
        correction2 = 1.0 - b2 ** self.steps
        denom = np.sqrt(v) / np.float32(correction2 ** 0.5) + np.float32(self.eps)
        p -= np.float32(self.lr / correction1) * (m / denom)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this shard keeps (the memory point 5 of issue 35 measures)."""
        return sum(a.nbytes for a in self.state.values())


@dataclass
class Clocks:
    """The server's view of the workers under ``ssp``/``asp``: each worker's clock (pushes
    applied), the server's version (updates applied), and the staleness every push saw."""

    workers: int
    staleness: int | None
    """The ``ssp`` bound ``s``; None for ``asp`` (no bound)."""
    version: int = 0
    clocks: list[int] = field(default_factory=list)
    seen: list[int] = field(default_factory=list)
    """The staleness of every push applied since :meth:`drain`."""

    def __post_init__(self) -> None:
        if not self.clocks:
            self.clocks = [0] * self.workers

    def may_pull(self, worker: int) -> bool:
        """Whether ``worker`` may pull now: always under ``asp``; under ``ssp`` while it is at
        most ``staleness`` pushes ahead of the slowest worker."""
        if self.staleness is None:
            return True
        return self.clocks[worker] - min(self.clocks) <= self.staleness

    def applied(self, worker: int, pulled_version: int) -> int:
        """Records that ``worker``'s push, computed on parameters of ``pulled_version``, was
        applied; returns the staleness it saw."""
        if not 0 <= pulled_version <= self.version:
            raise ValueError(f"worker {worker} pushed on version {pulled_version}; the server "
                             f"is at {self.version}")
        stale = self.version - pulled_version
        self.version += 1
        self.clocks[worker] += 1
        self.seen.append(stale)
        return stale

    def drain(self) -> dict[str, float]:
        """``staleness_mean`` and ``staleness_max`` of the pushes since the last call (both 0
        when none was applied), for the metrics."""
        seen, self.seen = self.seen, []
        if not seen:
            return {"staleness_mean": 0.0, "staleness_max": 0.0}
        return {"staleness_mean": float(np.mean(seen)), "staleness_max": float(max(seen))}
