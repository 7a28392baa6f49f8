"""LLaMA-style decoder over packed THD tokens: RMSNorm, RoPE, grouped-query attention,
SwiGLU (Touvron et al. 2023). Sizes come from `hcp.config.schema.LLMConfig`.

Parameter names (the FQNs init, freeze and checkpoints rely on): `embed_tokens.weight`,
`layers.{i}.attn_norm.weight`, `layers.{i}.attn.{q,k,v,o}_proj.weight`,
`layers.{i}.mlp_norm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`, `norm.weight`,
`lm_head.weight` (absent with `tie_embeddings`).
"""
from __future__ import annotations

import torch
from torch import nn

from hcp.config.schema import LLMConfig
from hcp.model.attention import thd_attention
from hcp.model.layers import RMSNorm, SwiGLU, apply_rope


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE. x: [T, H] -> [T, H]."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"llm: hidden_size {cfg.hidden_size} must be divisible by num_heads "
                             f"{cfg.num_heads}, which must be divisible by num_kv_heads "
                             f"{cfg.num_kv_heads}")
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.theta = cfg.rope_theta
        h, d = cfg.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, -1, self.head_dim), position_ids, self.theta)
        k = apply_rope(self.k_proj(x).view(t, -1, self.head_dim), position_ids, self.theta)
        v = self.v_proj(x).view(t, -1, self.head_dim)
        out = thd_attention(q, k, v, cu_seqlens, max_seqlen)
        return self.o_proj(out.reshape(t, -1))


class DecoderLayer(nn.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size)

    def forward(self, x, position_ids, cu_seqlens, max_seqlen):
        x = x + self.attn(self.attn_norm(x), position_ids, cu_seqlens, max_seqlen)
        return x + self.mlp(self.mlp_norm(x))


class LlamaDecoder(nn.Module):
    """Token embedding, decoder layers, final norm and LM head (untied unless
    `cfg.tie_embeddings`)."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size,
                                                                 bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: long [T] -> [T, H]."""
        return self.embed_tokens(input_ids)

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """inputs_embeds [T, H], position_ids long [T] (restarting per document), cu_seqlens
        int32 [N + 1], max_seqlen int -> final-normed hidden states [T, H]."""
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, position_ids, cu_seqlens, max_seqlen)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> logits [T, V]."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return hidden @ weight.t()
