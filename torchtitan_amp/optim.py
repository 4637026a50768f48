"""AdamW and the warm-up / stable / decay learning-rate schedule."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from torchtitan_amp.config import LRScheduler, Optimizer


def build_optimizer(params: list[nn.Parameter], cfg: Optimizer, device: torch.device) -> torch.optim.Optimizer:
    impl = cfg.implementation
    if impl == "auto":
        # Fused AdamW handles DTensor and plain params on CUDA; foreach is the safe CPU default.
        impl = "fused" if device.type == "cuda" else "foreach"
    return torch.optim.AdamW(
        params,
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
        fused=impl == "fused", foreach=impl == "foreach",
    )


def lr_factor(step: int, *, warmup: int, total: int, decay_ratio: float, decay_type: str,
              min_lr_factor: float) -> float:
    """Multiplier of the peak LR after `step` optimizer steps (step 0 = before the first step).

    Warm-up runs from 1/(warmup+1) to 1 so the first step never uses LR 0; then a stable phase,
    then decay over the last `decay_ratio` of steps (-1: all steps after warm-up) down to
    `min_lr_factor`, reached at step `total`. Decay never overlaps warm-up: when warmup + decay
    exceed `total`, decay is shortened so that it starts from the peak at the end of warm-up.
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    decay_steps = total - warmup if decay_ratio < 0 else round(total * decay_ratio)
    decay_steps = min(decay_steps, total - warmup)
    decay_start = total - decay_steps
    if step < decay_start or decay_steps <= 0:
        return 1.0
    progress = min((step - decay_start) / decay_steps, 1.0)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler,
                       total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    fn = partial(lr_factor, warmup=cfg.warmup_steps, total=total_steps, decay_ratio=cfg.decay_ratio,
                 decay_type=cfg.decay_type, min_lr_factor=cfg.min_lr_factor)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
