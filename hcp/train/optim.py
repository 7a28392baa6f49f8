"""AdamW over the trainable parameters, with weight decay on weight matrices only, and the
cosine learning-rate schedule with warmup that follows a changed schedule on resume."""
from __future__ import annotations

import math

import torch
from torch import nn

from hcp.config.choices import OPTIMIZERS


def decays(module: nn.Module, name: str, param: torch.Tensor) -> bool:
    """Whether weight decay applies to `param` (called `name` in `module`): weight matrices do;
    norms and biases (1-D), token embedding tables and position / CLS embeddings do not (the rule
    of Megatron-LM, and of LLaVA's Hugging Face trainer for norms and biases)."""
    if param.ndim < 2:
        return False
    return not (isinstance(module, nn.Embedding) or "Embedding" in type(module).__name__
                or name.endswith("embedding"))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters in two AdamW groups: `decay` (weight_decay) and `no_decay` (0),
    each `{"name", "params", "weight_decay"}`; a parameter shared by two modules counts once."""
    groups = {"decay": [], "no_decay": []}
    seen = set()
    for _, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                groups["decay" if decays(module, name, p) else "no_decay"].append(p)
    return [{"name": k, "params": v, "weight_decay": weight_decay if k == "decay" else 0.0}
            for k, v in groups.items()]


def build_optimizer(model: nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW with `optim.lr`, `optim.betas`, `optim.eps` over `model`'s trainable parameters,
    `optim.weight_decay` on weight matrices only (`decays`).

    Raises:
        ValueError: no trainable parameter (every module frozen) or an unknown `optim.name`
            (validation rejects both earlier, naming the field).
    """
    groups = param_groups(model, cfg.weight_decay)
    if not any(g["params"] for g in groups):
        raise ValueError("every module is frozen (vision/projector/llm .freeze=true): nothing to train")
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"optim.name={cfg.name!r}: use one of {OPTIMIZERS}")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def cosine_with_warmup(step: int, max_steps: int, warmup_ratio: float, min_lr_ratio: float) -> float:
    """LR multiplier at `step` (0-based): linear warmup over `ceil(warmup_ratio * max_steps)`
    steps, then cosine decay to `min_lr_ratio` at `max_steps` (LLaVA-1.5's schedule)."""
    warmup = math.ceil(warmup_ratio * max_steps)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class CosineWithWarmup(torch.optim.lr_scheduler.LambdaLR):
    """`cosine_with_warmup` over `max_steps` with peak `optim.lr`. Its state records the schedule
    (`max_steps`, `lr`, `warmup_ratio`, `min_lr_ratio`); loading a state saved under another
    schedule keeps the step count but follows THIS schedule from the very next step (the
    optimizer's learning rates are reset to it) and leaves `change_note` saying what changed."""

    def __init__(self, optimizer, optim_cfg, max_steps: int):
        self.schedule = {"max_steps": int(max_steps), "lr": float(optim_cfg.lr),
                         "warmup_ratio": float(optim_cfg.warmup_ratio),
                         "min_lr_ratio": float(optim_cfg.min_lr_ratio)}
        self.change_note = None
        s = self.schedule
        super().__init__(optimizer, lambda step: cosine_with_warmup(
            step, s["max_steps"], s["warmup_ratio"], s["min_lr_ratio"]))

    def state_dict(self) -> dict:
        return {**super().state_dict(), "schedule": dict(self.schedule)}

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict)
        old = state.pop("schedule", None)
        old_lr = state.get("_last_lr", [None])[0]
        super().load_state_dict(state)
        self.base_lrs = [self.schedule["lr"]] * len(self.optimizer.param_groups)
        factor = self.lr_lambdas[0](self.last_epoch)
        self._last_lr = [base * factor for base in self.base_lrs]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr
        changed = {k: (old[k], v) for k, v in self.schedule.items() if old and old[k] != v}
        if changed or (old is None and old_lr is not None and not math.isclose(old_lr, self._last_lr[0])):
            what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()) or "schedule"
            self.change_note = (f"learning-rate schedule changed on resume ({what}): step "
                                f"{self.last_epoch + 1} uses lr {self._last_lr[0]:.4g} (the saved "
                                f"schedule gave {old_lr:.4g}); every resumed step follows the new one")


def build_scheduler(optimizer, optim_cfg, max_steps: int) -> CosineWithWarmup:
    return CosineWithWarmup(optimizer, optim_cfg, max_steps)
