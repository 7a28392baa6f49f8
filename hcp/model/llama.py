"""LLaMA-style decoder over packed THD tokens: RMSNorm, RoPE, grouped-query attention,
SwiGLU (Touvron et al. 2023), with optional tensor, sequence and context parallelism.

Parameter names (the FQNs init, freeze and checkpoints rely on; the same under every layout):
`embed_tokens.weight`, `layers.{i}.attn_norm.weight`, `layers.{i}.attn.{q,k,v,o}_proj.weight`,
`layers.{i}.mlp_norm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`, `norm.weight`,
`lm_head.weight` (absent with `tie_embeddings`).

Parallelism (groups are passed in; None = size 1):
- TP over `tp_group`: q/k/v and gate/up column-parallel (query and kv heads split over TP ranks),
  o/down row-parallel, vocab-parallel embedding and LM head (logits stay vocab-sharded).
- Sequence parallelism (`sequence_parallel`, TP > 1): the residual stream between TP regions is
  split along tokens (padded to a multiple of tp); the final hidden states are gathered back.
- CP over `cp_group`: the caller passes this rank's head-tail shard of the tokens
  (`hcp.parallel.cp_sharding.cp_shard`) and the WHOLE micro-batch's cu_seqlens / max_seqlen;
  attention runs across the CP ranks with `cp_comm` (`allgather` or `p2p`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hcp.config.schema import LLMConfig
from hcp.model.backends import attention_fn, resolve_backend
from hcp.model.collectives import copy_to_group, gather_from_group, group_size, split_seq
from hcp.model.cp_attention import build_cp_plan, cp_attention
from hcp.model.layers import RMSNorm, SwiGLU, apply_rope
from hcp.model.tp import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE. x: [T, H] -> [T, H] (SP: [T / tp, H])."""

    def __init__(self, cfg: LLMConfig, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        tp = group_size(tp_group)
        if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"llm: hidden_size {cfg.hidden_size} must be divisible by num_heads "
                             f"{cfg.num_heads}, which must be divisible by num_kv_heads "
                             f"{cfg.num_kv_heads}")
        if cfg.num_kv_heads % tp:
            raise ValueError(f"llm: num_kv_heads {cfg.num_kv_heads} must be divisible by the TP "
                             f"size {tp} (each TP rank holds whole kv heads)")
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.theta = cfg.rope_theta
        h, d = cfg.hidden_size, self.head_dim
        par = dict(bias=False, tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.q_proj = ColumnParallelLinear(h, cfg.num_heads * d, **par)
        self.k_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d, **par)
        self.v_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d, **par)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, h, **par)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, attend) -> torch.Tensor:
        """attend(q [T, hq, D], k [T, hkv, D], v) -> [T, hq, D] (built by LlamaDecoder)."""
        q, k, v = (p(x) for p in (self.q_proj, self.k_proj, self.v_proj))
        t = q.shape[0]
        q = apply_rope(q.view(t, -1, self.head_dim), position_ids, self.theta)
        k = apply_rope(k.view(t, -1, self.head_dim), position_ids, self.theta)
        out = attend(q, k, v.view(t, -1, self.head_dim))
        return self.o_proj(out.reshape(t, -1))


class DecoderLayer(nn.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    def __init__(self, cfg: LLMConfig, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        sync = tp_group if sequence_parallel else None
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, grad_sync_group=sync)
        self.attn = Attention(cfg, tp_group, sequence_parallel)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, grad_sync_group=sync)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size, tp_group, sequence_parallel)

    def forward(self, x, position_ids, attend):
        x = x + self.attn(self.attn_norm(x), position_ids, attend)
        return x + self.mlp(self.mlp_norm(x))


class LlamaDecoder(nn.Module):
    """Token embedding, decoder layers, final norm and LM head (untied unless
    `cfg.tie_embeddings`).

    `cp_comm` and `sequence_parallel` default to `cfg.layout`'s values; sequence parallelism is
    off when the TP size is 1. Raises ValueError for sizes that do not split over TP.
    """

    def __init__(self, cfg: LLMConfig, tp_group=None, cp_group=None, cp_comm: str | None = None,
                 sequence_parallel: bool | None = None):
        super().__init__()
        self.cfg, self.tp_group, self.cp_group = cfg, tp_group, cp_group
        self.cp_comm = cfg.layout.cp_comm if cp_comm is None else cp_comm
        sp = cfg.layout.sequence_parallel if sequence_parallel is None else sequence_parallel
        self.sequence_parallel = sp and group_size(tp_group) > 1
        backend = resolve_backend(cfg.attention_backend)  # te/flash missing: fails here, early
        if backend != "torch" and group_size(cp_group) > 1:
            raise ValueError(f"llm.attention_backend={backend} does not run with CP yet: "
                             "use llm.attention_backend=torch (or auto)")
        sp = self.sequence_parallel
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_group)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp_group, sp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, grad_sync_group=tp_group if sp else None)
        self.lm_head = None if cfg.tie_embeddings else ColumnParallelLinear(
            cfg.hidden_size, cfg.vocab_size, bias=False, tp_group=tp_group)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: long [T] -> [T, H]."""
        return self.embed_tokens(input_ids)

    def _attend(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int):
        """Attention over the first len(x) rows (later rows are SP padding: zeros out)."""
        num_tokens = x.shape[0]
        if group_size(self.cp_group) > 1:
            plan = build_cp_plan(cu_seqlens, self.cp_group, self.cp_comm)
            core = lambda q, k, v: cp_attention(q, k, v, plan)  # noqa: E731
        else:
            fn = attention_fn(resolve_backend(self.cfg.attention_backend, x.device, x.dtype))
            core = lambda q, k, v: fn(q, k, v, cu_seqlens, max_seqlen)  # noqa: E731

        def attend(q, k, v):
            out = core(q[:num_tokens], k[:num_tokens], v[:num_tokens])
            return F.pad(out, (0, 0, 0, 0, 0, q.shape[0] - num_tokens))
        return attend

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """inputs_embeds [T, H], position_ids long [T] (restarting per document), cu_seqlens
        int32 [N + 1], max_seqlen int -> final-normed hidden states [T, H]. Under CP, T is this
        rank's shard while cu_seqlens / max_seqlen describe the whole micro-batch."""
        t = inputs_embeds.shape[0]
        attend = self._attend(inputs_embeds, cu_seqlens, max_seqlen)
        x = inputs_embeds
        if self.sequence_parallel:
            pad = -t % group_size(self.tp_group)
            x = split_seq(F.pad(x, (0, 0, 0, pad)), self.tp_group)
            position_ids = F.pad(position_ids, (0, pad))
        for layer in self.layers:
            x = layer(x, position_ids, attend)
        x = self.norm(x)
        if not self.sequence_parallel:
            return x
        # every TP rank consumes the whole gathered sequence (the LM head copies it into the TP
        # region), so each rank's slice gets its full gradient back: backward keeps the slice
        return gather_from_group(x, self.tp_group, dim=0)[:t]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> logits [T, V / tp] (this TP rank's vocabulary slice)."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return F.linear(copy_to_group(hidden, self.tp_group), self.embed_tokens.weight)
