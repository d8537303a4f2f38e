"""The ``ps`` gradient exchange for PyTorch (:mod:`hvdtrain.ps.exchange`): tensors to one flat
NumPy vector and back; the optimizer stays the run's own (no ``DistributedOptimizer``). Under
``ps.consistency=ssp``/``asp`` the servers run the optimizer and the run's optimizer becomes
:class:`ServerSide`, which only carries the learning rate."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from hvdtrain.ps.exchange import AsyncPSExchange, PSExchange, ServerOptimizer
from hvdtrain.torch.collectives import any_rank


class TorchPSExchange(PSExchange):
    """:class:`hvdtrain.ps.exchange.PSExchange` over torch gradients (CPU or GPU). Given the
    parameters with ``overlap``, it hooks each one's gradient accumulation, so that each
    gradient is written into the flat vector, and its chunks pushed, as the backward pass
    finishes it (``ps.overlap``)."""

    device = torch.device("cpu")

    def __init__(self, client: Any, rank: int, size: int, params: Sequence[torch.nn.Parameter],
                 overlap: bool = False) -> None:
        super().__init__(client, rank, size, [p.shape for p in params], overlap)
        if self.streams:
            self.device = params[0].device if params else self.device
            for index, param in enumerate(params):
                param.register_post_accumulate_grad_hook(functools.partial(self._hook, index))

    def _hook(self, index: int, param: torch.Tensor) -> None:
        self.produced(index, param.grad)

    def write(self, grad: torch.Tensor, out: np.ndarray) -> None:
        torch.from_numpy(out).copy_(grad.detach().reshape(-1))

    def flatten(self, grads: Sequence[torch.Tensor]) -> np.ndarray:
        self.device = grads[0].device if grads else self.device
        flat = torch.cat([g.detach().reshape(-1).to("cpu", torch.float32) for g in grads])
        return flat.numpy()

    def unflatten(self, flat: np.ndarray) -> list[torch.Tensor]:
        return [torch.from_numpy(part).to(self.device) for part in self.split(flat)]

    def any_rank(self, flag: bool) -> bool:
        return any_rank(flag)


class ServerSide(torch.optim.Optimizer):
    """The workers' optimizer under ``ssp``/``asp``: its ``lr`` is what the pushes carry; its
    step does nothing (the servers updated the parameters the exchange assigned).

    Its groups keep the replaced optimizer's settings (``defaults``), so that a checkpoint of an
    ``asp`` run still loads into that optimizer when it resumes under ``bsp``."""

    def __init__(self, params: Iterable[torch.nn.Parameter], defaults: dict[str, Any]) -> None:
        super().__init__(params, dict(defaults))

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Nothing to do: the exchange already took the servers' parameters."""
        return None


class TorchAsyncPSExchange(TorchPSExchange, AsyncPSExchange):
    """:class:`hvdtrain.ps.exchange.AsyncPSExchange` over a torch model's parameters."""

    def __init__(self, client: Any, rank: int, size: int, params: Sequence[torch.nn.Parameter],
                 optimizer: ServerOptimizer, worker_optimizer: ServerSide) -> None:
        AsyncPSExchange.__init__(self, client, rank, size, [p.shape for p in params], optimizer)
        self.params, self.worker_optimizer = list(params), worker_optimizer
        self.device = self.params[0].device if self.params else self.device

    def learning_rate(self) -> float:
        return float(self.worker_optimizer.param_groups[0]["lr"])

    def flat_params(self) -> np.ndarray:
        return self.flatten([p.detach() for p in self.params]).copy()

    @torch.no_grad()
    def assign(self, flat: np.ndarray) -> None:
        for p, part in zip(self.params, self.split(flat), strict=True):
            p.copy_(torch.from_numpy(part))
