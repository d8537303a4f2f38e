"""Learning-rate schedule, shared by both engines: world-size scaling, warm-up, decay."""

from __future__ import annotations

import math

from hvdtrain.config import OptimConfig


def peak_lr(cfg: OptimConfig, world_size: int) -> float:
    """The learning rate after warm-up: ``lr``, times the world size when ``scale_lr`` is on."""
    return cfg.lr * world_size if cfg.scale_lr else cfg.lr


def lr_at(step: int, total_steps: int, cfg: OptimConfig, world_size: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``.

    Warm-up rises linearly from the one-rank ``lr`` to the peak, as in Goyal et al. (2017), so that
    a large scaled rate does not hit the freshly initialised model at once.
    """
    peak = peak_lr(cfg, world_size)
    if step < cfg.warmup_steps:
        return cfg.lr + (peak - cfg.lr) * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak
