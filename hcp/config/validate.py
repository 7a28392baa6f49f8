"""Cross-field validation of a composed config, run once in the launching process before any
rank or process group starts. Each rule raises `ConfigError(field, value, problem, fix)`."""
from __future__ import annotations

import importlib.util

from omegaconf import OmegaConf

from hcp.config.errors import ConfigError, check_choice
from hcp.config.layouts import check_layouts

_CHOICES = {  # placement, packing, cp_comm and recompute: hcp.config.layouts
    "mode": ("train", "plan", "export"),
    "export.dtype": ("auto", "float32", "bfloat16", "float16"),
    "data.long_docs": ("split", "reject"),
    "precision": ("fp32", "bf16"),
    "logger.name": ("wandb", "none"),
    "data.on_error": ("error", "skip"),
    "launcher.backend": ("auto", "nccl", "gloo"),
    "launcher.start_method": ("fork", "spawn", "forkserver"),
    "llm.attention_backend": ("auto", "torch", "te", "flash"),
}
_BACKEND_PACKAGES = {
    "te": ("transformer_engine", "pip install --no-build-isolation 'transformer_engine[pytorch]' "
                                 "on a CUDA machine (NVIDIA's package)"),
    "flash": ("flash_attn", "pip install flash-attn --no-build-isolation on a CUDA machine"),
}


def check_choices(cfg) -> None:
    for key, allowed in _CHOICES.items():
        check_choice(key, OmegaConf.select(cfg, key), allowed)


def check_backends(cfg) -> None:
    """An optional GPU backend asked for by name must be importable (checked without importing
    it: `import transformer_engine` raises on machines without CUDA)."""
    backend = cfg.llm.attention_backend
    if backend in _BACKEND_PACKAGES:
        package, how = _BACKEND_PACKAGES[backend]
        if importlib.util.find_spec(package) is None:
            raise ConfigError("llm.attention_backend", backend, f"the `{package}` package is not "
                              "installed", f"{how}, or set llm.attention_backend=auto")


def check_model(cfg) -> None:
    v = cfg.vision
    if (v is None) != (cfg.projector is None):
        raise ConfigError("projector", cfg.projector, "vision and projector must both be set or both "
                          "be null", "set both (LLaVA) or `vision: null` and `projector: null` (text LM)")
    if v is not None:
        check_choice("vision.arch", v.arch, ("vit", "clip"))
    if v is not None and v.image_size % v.patch_size:
        raise ConfigError("vision.patch_size", v.patch_size, f"does not divide vision.image_size="
                          f"{v.image_size}", "pick a patch size that divides the image size")
    present = {"llm"} | ({"vision", "projector"} if v is not None else set())
    if all(cfg[m].freeze for m in present):
        raise ConfigError("llm.freeze", True, f"every module ({', '.join(sorted(present))}) is frozen: "
                          "nothing would train", "unfreeze one, e.g. llm.freeze=false or +stage=pretrain")
    for edge in cfg.graph.edges:
        for name in edge:
            if name not in present:
                raise ConfigError("graph.edges", list(edge), f"module {name!r} is not configured",
                                  f"use modules among {sorted(present)} or configure {name}")


def check_trainer(cfg, layouts) -> None:
    t = cfg.trainer
    for key in ("max_steps", "global_batch_size", "micro_batch_tokens", "log_every"):
        if t[key] < 1:
            raise ConfigError(f"trainer.{key}", t[key], "must be >= 1", "use a positive value")
    if cfg.optim.lr <= 0:
        raise ConfigError("optim.lr", cfg.optim.lr, "must be > 0", "use e.g. optim.lr=1e-3")
    # micro_batch_tokens is a per-rank capacity: a document may span the CP group (or, under
    # dynamic CP, the whole CP pool), so the longest sample is that many ranks' worth.
    llm = layouts["llm"]
    span = llm.cp_pool if cfg.packing == "dynamic_cp" else llm.cp
    if t.micro_batch_tokens * span < cfg.data.max_seq_len:
        raise ConfigError("trainer.micro_batch_tokens", t.micro_batch_tokens,
                          f"x {span} CP ranks is smaller than data.max_seq_len={cfg.data.max_seq_len}: "
                          "a longest sample would not fit", "raise trainer.micro_batch_tokens or "
                          "llm.layout.cp, or lower data.max_seq_len")


def validate(cfg, world_size: int) -> dict:
    """Run every rule on `cfg` for `world_size` ranks; return the resolved layouts
    ({module: `hcp.config.layouts.ResolvedLayout`}).

    Raises:
        ConfigError: the first rule broken, naming the field, the value and a fix.
    """
    check_choices(cfg)
    check_backends(cfg)
    check_model(cfg)
    layouts = check_layouts(cfg, world_size)
    check_trainer(cfg, layouts)
    return layouts
