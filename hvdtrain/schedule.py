"""Learning-rate schedule, shared by both engines: world-size scaling, warm-up, decay."""

from __future__ import annotations

import math

from hvdtrain.config import OptimConfig


def peak_lr(cfg: OptimConfig, world_size: int, base_lr: float | None = None) -> float:
    """The learning rate after warm-up: the one-rank rate (``base_lr``, else ``lr``), times the
    world size when ``scale_lr`` is on."""
    lr = cfg.lr if base_lr is None else base_lr
    return lr * world_size if cfg.scale_lr else lr


def lr_at(step: int, total_steps: int, cfg: OptimConfig, world_size: int,
          base_lr: float | None = None) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``.

    ``base_lr`` is the one-rank rate when it differs from ``lr`` (elastic mode's
    ``keep_global_batch``, :attr:`hvdtrain.world.World.lr`). Warm-up rises linearly from the
    one-rank rate to the peak, as in Goyal et al. (2017), so that a large scaled rate does not hit
    the freshly initialised model at once.
    """
    lr = cfg.lr if base_lr is None else base_lr
    peak = peak_lr(cfg, world_size, lr)
    if step < cfg.warmup_steps:
        return lr + (peak - lr) * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak
