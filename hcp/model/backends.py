"""Attention backend selection (`llm.attention_backend`): `torch` (pure torch THD attention, the
CPU reference and the only one with CP here), `flash` (flash-attn's varlen kernel), `te`
(Transformer Engine's fused attention, `qkv_format="thd"`). `auto` picks flash, then te, when
installed, the run computes in fp16/bf16 on CUDA (their kernels take no fp32) and no micro-batch
uses CP; else torch. A run resolves its backend once, when it builds the model, from its device,
its compute dtype (`hcp.config.precision.Precision.compute`, not the residual stream's dtype,
which stays fp32 under autocast) and its largest CP group. The GPU libraries are imported
lazily, only when chosen.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

from hcp.config.choices import ATTENTION_BACKENDS as BACKENDS
from hcp.config.choices import BACKEND_MODULES as _MODULES
from hcp.config.choices import check_cp_backend
from hcp.model.attention import thd_attention


def _importable(name: str) -> bool:
    try:
        importlib.import_module(_MODULES[name][0])
    except Exception:  # noqa: BLE001 - TE raises OSError/RuntimeError without CUDA libraries
        return False
    return True


def resolve_backend(name: str, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, cp: int = 1, dynamic: bool = False) -> str:
    """Return the concrete backend for `name` in a run on `device` computing in `dtype` whose
    micro-batches use CP groups of up to `cp` ranks (`dynamic`: the CP pool of
    `packing=dynamic_cp`).

    Raises:
        ValueError: unknown name; ConfigError (a ValueError): a GPU backend with CP
            (`hcp.config.choices.check_cp_backend`).
        ImportError: `te`/`flash` asked for but not importable (the message says how to install).
    """
    if name not in BACKENDS:
        raise ValueError(f"llm.attention_backend={name!r} is unknown: use one of {BACKENDS}")
    check_cp_backend(name, cp, dynamic)
    if name == "auto":
        if (cp == 1
            and torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)):
            return next((b for b in ("flash", "te") if _importable(b)), "torch")
        return "torch"
    if name != "torch" and not _importable(name):
        module, how = _MODULES[name]
        raise ImportError(f"llm.attention_backend={name} needs `{module}`, which is not importable "
                          f"here: {how}; or set llm.attention_backend=torch")
    return name


def attention_fn(backend: str) -> Callable:
    """`fn(q [T, Hq, D], k [T, Hkv, D], v, cu_seqlens, max_seqlen, seqlens) -> [T, Hq, D]` for
    a concrete backend (see `resolve_backend`); `seqlens`, the document lengths on the host,
    is what the `torch` backend splits by (flash and te read cu_seqlens on the device)."""
    if backend == "flash":
        flash_attn = importlib.import_module("flash_attn")

        def flash(q, k, v, cu_seqlens, max_seqlen, seqlens=None):
            return flash_attn.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens,
                                                     max_seqlen, max_seqlen, causal=True)
        return flash
    if backend == "te":
        te = importlib.import_module("transformer_engine.pytorch")
        cores: dict = {}

        def fused(q, k, v, cu_seqlens, max_seqlen, seqlens=None):
            key = (q.shape[1], k.shape[1], q.shape[2])
            if key not in cores:
                cores[key] = te.DotProductAttention(q.shape[1], q.shape[2],
                                                    num_gqa_groups=k.shape[1],
                                                    attn_mask_type="padding_causal",
                                                    qkv_format="thd")
            return cores[key](q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                              max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen).view_as(q)
        return fused
    return thd_attention
