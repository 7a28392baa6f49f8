"""Transformer building blocks in THD form: RMSNorm, rotary position embedding, SwiGLU MLP.

Sources: RMSNorm (Zhang & Sennrich 2019), RoPE (Su et al. 2021, "rotate half" convention of
LLaMA / Hugging Face), SwiGLU (Shazeer 2020). Tensors are token-major: `[T, ...]`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hcp.model.collectives import copy_to_group
from hcp.model.tp import ColumnParallelLinear, RowParallelLinear


class RMSNorm(nn.Module):
    """`x / rms(x) * weight` over the last dimension; computed in fp32, returned in x's dtype.

    `grad_sync_group`: under sequence parallelism each TP rank normalizes different tokens, so
    the weight's gradient is summed over that group (None: no sum).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, grad_sync_group=None):
        super().__init__()
        self.eps, self.grad_sync_group = eps, grad_sync_group
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., H] -> [..., H]."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * copy_to_group(self.weight, self.grad_sync_group)


def rope_tables(position_ids: torch.Tensor, head_dim: int, theta: float,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, head_dim] in `dtype` for integer positions [T] (computed in fp32).
    Compute once per micro-batch; every layer's `rotate` reuses them."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                            dtype=torch.float32) / head_dim)
    freqs = position_ids.to(torch.float32)[:, None] * inv_freq[None, :]   # [T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]                     # [T, 1, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate query/key heads x [T, heads, D] by tables cos, sin [T, 1, D] (`rope_tables`),
    in x's dtype."""
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def apply_rope(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate query/key heads by their positions.

    x: [T, heads, D] (D even); position_ids: [T] integer positions within each document;
    theta: base of the frequencies (10000 for LLaMA). Returns [T, heads, D].
    """
    return rotate(x, *rope_tables(position_ids, x.shape[-1], theta, x.dtype))


class SwiGLU(nn.Module):
    """LLaMA MLP: `down(silu(gate(x)) * up(x))`, no biases. x: [T, H] -> [T, H] (under sequence
    parallelism [T / tp, H]). gate/up are column-parallel, down row-parallel over `tp_group`."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, tp_group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        col = dict(bias=False, tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.gate_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, **col)
        self.up_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, **col)
        self.down_proj = RowParallelLinear(ffn_hidden_size, hidden_size, **col)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
