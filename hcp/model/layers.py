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


def apply_rope(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate query/key heads by their positions.

    x: [T, heads, D] (D even); position_ids: [T] integer positions within each document;
    theta: base of the frequencies (10000 for LLaMA). Returns [T, heads, D].
    """
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    freqs = position_ids.to(torch.float32)[:, None] * inv_freq[None, :]   # [T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]                     # [T, 1, D]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


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
