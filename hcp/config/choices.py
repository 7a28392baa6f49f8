"""Named options that several layers check: defined once here (config is the top layer, so the
model and training code import these, never the other way round)."""
from __future__ import annotations

OPTIMIZERS = ("adamw",)
"""`optim.name` values (hcp.train.optim)."""
PROJECTOR_TYPES = ("mlp2x_gelu", "linear")
"""`projector.type` values (hcp.model.projector)."""
ATTENTION_BACKENDS = ("auto", "torch", "te", "flash")
"""`llm.attention_backend` values (hcp.model.backends)."""
BACKEND_MODULES = {
    "te": ("transformer_engine.pytorch", "pip install --no-build-isolation 'transformer_engine[pytorch]' "
                                         "on a CUDA machine (NVIDIA's package)"),
    "flash": ("flash_attn", "pip install flash-attn --no-build-isolation on a CUDA machine"),
}
"""Optional GPU attention backends: name -> (module to import, how to install it)."""
CP_BACKENDS = ("auto", "torch", "te")
"""Backends that run context parallelism (CP > 1): `auto` and `torch` run hcp's CP attention on
fused kernels, `te` Transformer Engine's THD CP (hcp.model.cp_attention.cp_attention_for)."""
