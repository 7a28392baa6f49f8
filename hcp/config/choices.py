"""Named options that several layers check: defined once here (config is the top layer, so the
model and training code import these, never the other way round)."""
from __future__ import annotations

from hcp.config.errors import ConfigError

OPTIMIZERS = ("adamw",)
"""`optim.name` values (hcp.train.optim)."""
ENCODER_ARCHS = ("vit", "clip")
"""`vision.arch` / `encoders.NAME.arch` values; each has one builder in
`hcp.model.encoder_types.ENCODERS` (a new encoder type joins both; that module checks they
match)."""
PROJECTOR_TYPES = ("mlp2x_gelu", "linear")
"""`projector.type` values (hcp.model.projector)."""
ATTENTION_BACKENDS = ("auto", "torch", "te", "flash")
"""`llm.attention_backend` values (hcp.model.backends)."""
BACKEND_MODULES = {
    "te": ("transformer_engine.pytorch",
           "pip install --no-build-isolation 'transformer_engine[pytorch]' "
                                         "on a CUDA machine (NVIDIA's package)"),
    "flash": ("flash_attn", "pip install flash-attn --no-build-isolation on a CUDA machine"),
}
"""Optional GPU attention backends: name -> (module to import, how to install it)."""
FSDP_REDUCE = ("per_micro_batch", "per_step")
"""`trainer.fsdp_reduce` values (hcp.train.fsdp.grad_sync, hcp.preflight.memory)."""
CP_BACKENDS = ("auto", "torch", "te")
"""Backends that run context parallelism (CP > 1): `auto` and `torch` run hcp's CP attention on
fused kernels, `te` Transformer Engine's THD CP (hcp.model.cp_attention.cp_attention_for)."""


def check_cp_backend(backend: str, cp: int, dynamic: bool = False) -> None:
    """The one CP x attention-backend rule: a run whose micro-batches may use a CP group of more
    than one rank takes only a backend of `CP_BACKENDS` (CP attention is hcp's own torch code).
    `cp`: the largest CP group of the run: `llm.layout.cp`, or under `packing=dynamic_cp`
    (`dynamic`) the CP pool dp * cp, any power of two up to which the solver may pick.
    Checked by validation (before any rank starts) and by the backend's resolution at build
    time (`hcp.model.backends.resolve_backend`). Raises ConfigError."""
    if cp <= 1 or backend in CP_BACKENDS:
        return
    where = (f"packing=dynamic_cp may run a micro-batch on up to the whole CP pool of {cp} ranks"
             if dynamic else f"llm.layout.cp={cp}")
    fix = "packing=first_fit with llm.layout.cp=1" if dynamic else "llm.layout.cp=1"
    raise ConfigError("llm.attention_backend", backend, f"does not run with context parallelism "
                      f"yet ({where}); CP attention is hcp's own torch code",
                      f"set llm.attention_backend=auto (or torch), or {fix}")
