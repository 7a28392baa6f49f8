"""AdamW over the trainable parameters and the cosine learning-rate schedule with warmup."""
from __future__ import annotations

import math

import torch


def build_optimizer(params, cfg) -> torch.optim.AdamW:
    """AdamW with `optim.lr`, `optim.betas`, `optim.eps`, `optim.weight_decay`.

    Raises:
        ValueError: no trainable parameter (every module frozen) or an unknown `optim.name`.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("every module is frozen (vision/projector/llm .freeze=true): nothing to train")
    if cfg.name != "adamw":
        raise ValueError(f"optim.name={cfg.name!r}: only `adamw` is supported")
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


def cosine_with_warmup(step: int, max_steps: int, warmup_ratio: float, min_lr_ratio: float) -> float:
    """LR multiplier at `step` (0-based): linear warmup over `ceil(warmup_ratio * max_steps)`
    steps, then cosine decay to `min_lr_ratio` at `max_steps` (LLaVA-1.5's schedule)."""
    warmup = math.ceil(warmup_ratio * max_steps)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer, optim_cfg, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine_with_warmup(
        s, max_steps, optim_cfg.warmup_ratio, optim_cfg.min_lr_ratio))
