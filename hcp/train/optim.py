"""AdamW over the trainable parameters with one parameter group per module and decay class
(weight decay on weight matrices only, a module's own lr / weight decay from `<module>.optim`),
and the cosine learning-rate schedule with warmup that follows a changed config on resume."""
from __future__ import annotations

import math

import torch
from torch import nn

from hcp.config.choices import OPTIMIZERS
from hcp.config.schema import OptimConfig


def decays(module: nn.Module, name: str, param: torch.Tensor) -> bool:
    """Whether weight decay applies to `param` (called `name` in `module`): weight matrices do;
    norms and biases (1-D), token embedding tables and position / CLS embeddings do not (the rule
    of Megatron-LM, and of LLaVA's Hugging Face trainer for norms and biases)."""
    if param.ndim < 2:
        return False
    return not (isinstance(module, nn.Embedding) or "Embedding" in type(module).__name__
                or name.endswith("embedding"))


def module_overrides(specs) -> dict[str, dict]:
    """Each module's own optimizer settings, {module: {"lr": ..., "weight_decay": ...}} with only
    the fields it sets (`<module>.optim`, `hcp.config.specs.ModuleSpec.optim`); modules setting
    nothing are left out. `specs`: `hcp.config.specs.ModuleSpecs`."""
    return {m.name: dict(m.optim) for m in specs if m.optim}


def param_groups(model: nn.Module, weight_decay: float, lr: float | None = None,
                 overrides: dict[str, dict] | None = None) -> list[dict]:
    """The trainable parameters in AdamW groups, one per module (the first part of the FQN:
    `vision`, `projector`, `llm`; "" for the root's own parameters) and decay class (`decays`),
    named `{module}.decay` / `{module}.no_decay` (`decay` / `no_decay` for the root), each
    `{"name", "params", "lr", "weight_decay"}` in the order the modules come, empty groups left
    out. A module's `lr` / `weight_decay` come from `overrides[module]` when set there, else
    `lr` (None: the optimizer's default) and `weight_decay`; no_decay groups always have 0.
    A parameter shared by two modules counts once (in the first)."""
    overrides = overrides or {}
    groups: dict[str, dict] = {}
    seen = set()
    for path, module in model.named_modules():
        owner = path.split(".")[0]
        own = overrides.get(owner, {})
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            kind = "decay" if decays(module, name, p) else "no_decay"
            key = f"{owner}.{kind}" if owner else kind
            if key not in groups:
                group = {"name": key, "params": [],
                         "weight_decay": own.get("weight_decay", weight_decay) if kind == "decay"
                         else 0.0}
                peak = own.get("lr", lr)
                if peak is not None:
                    group["lr"] = peak
                groups[key] = group
            groups[key]["params"].append(p)
    return list(groups.values())


def build_optimizer(model: nn.Module, optim: OptimConfig,
                    overrides: dict[str, dict] | None = None) -> torch.optim.AdamW:
    """AdamW with `optim.lr`, `optim.betas`, `optim.eps` (`optim`: the run's `optim` block) over
    `model`'s trainable parameters in per-module groups (`param_groups`), `optim.weight_decay`
    on weight matrices only (`decays`); `overrides` (`module_overrides(specs)`) sets a module's
    own lr / weight decay.
    Parameter groups differ between ranks (a pipeline stage holds some modules only); the
    checkpoint keys their settings by parameter FQN (`hcp.train.checkpoint`), so any layout
    resumes them.

    Raises:
        ValueError: no trainable parameter (every module frozen) or an unknown `optim.name`
            (validation rejects both earlier, naming the field).
    """
    groups = param_groups(model, optim.weight_decay, optim.lr, overrides)
    if not groups:
        raise ValueError("every module is frozen (vision/projector/llm .freeze=true): nothing to "
                         "train")
    if optim.name not in OPTIMIZERS:
        raise ValueError(f"optim.name={optim.name!r}: use one of {OPTIMIZERS}")
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)


def cosine_with_warmup(step: int, max_steps: int, warmup_ratio: float,
                       min_lr_ratio: float) -> float:
    """LR multiplier at `step` (0-based): linear warmup over `ceil(warmup_ratio * max_steps)`
    steps, then cosine decay to `min_lr_ratio` at `max_steps` (LLaVA-1.5's schedule)."""
    warmup = math.ceil(warmup_ratio * max_steps)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class CosineWithWarmup(torch.optim.lr_scheduler.LambdaLR):
    """`cosine_with_warmup` over `max_steps`, scaling every parameter group's own peak lr (its
    module's `<module>.optim.lr`, else `optim.lr`). Its state records the schedule (`max_steps`,
    `lr`, `warmup_ratio`, `min_lr_ratio`, and each group's `[peak lr, weight decay]` by group
    name). Loading a state saved under another config keeps the step count but follows THIS
    config from the very next step: every group's peak lr and weight decay are reset to this
    run's (loading the optimizer's checkpoint brought the saved ones), and `change_note` says
    what changed. `lr` is the schedule's current value of `optim.lr` (what the log reports)."""

    def __init__(self, optimizer, optim_cfg: OptimConfig, max_steps: int):
        self.schedule = {"max_steps": int(max_steps), "lr": float(optim_cfg.lr),
                         "warmup_ratio": float(optim_cfg.warmup_ratio),
                         "min_lr_ratio": float(optim_cfg.min_lr_ratio)}
        self.groups = [{"name": g.get("name"), "lr": g["lr"], "weight_decay": g["weight_decay"]}
                       for g in optimizer.param_groups]  # this run's config, before any resume
        self.change_note = None
        s = self.schedule
        super().__init__(optimizer, lambda step: cosine_with_warmup(
            step, s["max_steps"], s["warmup_ratio"], s["min_lr_ratio"]))

    @property
    def lr(self) -> float:
        """`optim.lr` times the schedule's factor at the current step."""
        return self.schedule["lr"] * self.lr_lambdas[0](self.last_epoch)

    def _by_name(self) -> dict[str, list[float]]:
        return {g["name"]: [g["lr"], g["weight_decay"]] for g in self.groups if g["name"]}

    _OWN = ("schedule", "groups", "change_note")  # this run's config: never restored

    def state_dict(self) -> dict:
        state = {k: v for k, v in super().state_dict().items() if k not in self._OWN}
        return {**state, "schedule": {**self.schedule, "groups": self._by_name()}}

    def load_state_dict(self, state_dict: dict) -> None:
        state = {k: v for k, v in state_dict.items() if k not in self._OWN}
        old = state_dict.get("schedule")
        old_lr = state.get("_last_lr", [None])[0]
        super().load_state_dict(state)
        self.base_lrs = [g["lr"] for g in self.groups]
        factor = self.lr_lambdas[0](self.last_epoch)
        self._last_lr = [base * factor for base in self.base_lrs]
        for group, mine, lr in zip(self.optimizer.param_groups, self.groups, self._last_lr):
            group.update(lr=lr, initial_lr=mine["lr"], weight_decay=mine["weight_decay"])
            if mine["name"] is not None:
                group["name"] = mine["name"]
        now = self.lr
        if old is not None:
            changed = [f"{k} {old[k]} -> {v}" for k, v in self.schedule.items() if old[k] != v]
            saved = old.get("groups", {})
            for name, (lr, wd) in self._by_name().items():  # groups this rank and rank 0 share
                if name in saved and saved[name] != [lr, wd]:
                    changed.append(f"{name} [lr, weight_decay] {saved[name]} -> {[lr, wd]}")
            before = old["lr"] * cosine_with_warmup(self.last_epoch, old["max_steps"],
                                                    old["warmup_ratio"], old["min_lr_ratio"])
        else:  # a state from before the schedule was recorded: compare the learning rate itself
            changed = ([] if old_lr is None
                       or math.isclose(old_lr, self._last_lr[0]) else ["schedule"])
            before = old_lr
        if changed:
            self.change_note = (f"optimizer config changed on resume ({', '.join(changed)}): step "
                                f"{self.last_epoch + 1} uses lr {now:.4g} (the saved schedule gave "
                                f"{before:.4g}); every resumed step follows the new one")


def build_scheduler(optimizer, optim_cfg: OptimConfig, max_steps: int) -> CosineWithWarmup:
    return CosineWithWarmup(optimizer, optim_cfg, max_steps)
