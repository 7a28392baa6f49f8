"""LLaMA-style decoder over packed THD tokens: RMSNorm, RoPE, grouped-query attention, SwiGLU
(Touvron et al. 2023), with optional tensor, sequence, context and pipeline parallelism.

Parameter names (the same under every layout): `embed_tokens.weight`,
`layers.{i}.attn_norm.weight`, `layers.{i}.attn.{q,k,v,o}_proj.weight`,
`layers.{i}.mlp_norm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`, `norm.weight`,
`lm_head.weight` (absent when tied). Groups are passed in (None = size 1). TP (`tp_group`): q/k/v
and gate/up column-parallel, o/down row-parallel, vocab-parallel embedding and head. Sequence
parallelism splits the residual stream along tokens between TP regions. CP (`cp_group`): the caller
passes this rank's head-tail shard and the WHOLE micro-batch's cu_seqlens
(`hcp.model.cp_attention.cp_attention_for` picks the CP attention once). PP (`stage`): only the
stage's layers are built, under their global indices; `forward` = `enter` (first) -> `run_layers` ->
`exit` (last). Recompute (`recompute`): `selective` recomputes the attention core (Korthikanti et
al. 2022), `full` the whole layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hcp.config.specs import LLMArch
from hcp.model.attention import host_seqlens
from hcp.model.backends import attention_fn, resolve_backend
from hcp.model.collectives import copy_to_group, gather_from_group, group_size, split_seq
from hcp.model.cp_attention import cp_attention_for
from hcp.model.layers import RMSNorm, SwiGLU, rope_tables, rotate
from hcp.model.stage import StageSpec
from hcp.parallel.cp_sharding import cu_of
from hcp.model.tp import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


_DECODER_GROUP = object()
"""run_layers' default cp_group: the decoder's own."""


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE. x: [T, H] -> [T, H] (SP: [T / tp, H])."""

    def __init__(self, cfg: LLMArch, tp_group=None, sequence_parallel: bool = False,
                 recompute_core: bool = False):
        super().__init__()
        self.recompute_core = recompute_core
        tp = group_size(tp_group)
        if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"llm: hidden_size {cfg.hidden_size} must be divisible by num_heads "
                             f"{cfg.num_heads}, which must be divisible by num_kv_heads "
                             f"{cfg.num_kv_heads}")
        if cfg.num_kv_heads % tp:
            raise ValueError(f"llm: num_kv_heads {cfg.num_kv_heads} must be divisible by the TP "
                             f"size {tp} (each TP rank holds whole kv heads)")
        self.head_dim = cfg.hidden_size // cfg.num_heads
        h, d = cfg.hidden_size, self.head_dim
        par = dict(bias=False, tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.q_proj = ColumnParallelLinear(h, cfg.num_heads * d, **par)
        self.k_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d, **par)
        self.v_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d, **par)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, h, **par)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attend) -> torch.Tensor:
        """rope: (cos, sin) [T, 1, D] of this micro-batch (`rope_tables`); attend(q [T, hq, D],
        k [T, hkv, D], v) -> [T, hq, D] (both built once per micro-batch by LlamaDecoder)."""
        q, k, v = (p(x) for p in (self.q_proj, self.k_proj, self.v_proj))
        t = q.shape[0]
        q = rotate(q.view(t, -1, self.head_dim), *rope)
        k = rotate(k.view(t, -1, self.head_dim), *rope)
        v = v.view(t, -1, self.head_dim)
        out = (checkpoint(attend, q, k, v, use_reentrant=False) if self.recompute_core
               else attend(q, k, v))
        return self.o_proj(out.reshape(t, -1))


class DecoderLayer(nn.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`. `recompute`: see the
    module docstring."""

    def __init__(self, cfg: LLMArch, tp_group=None, sequence_parallel: bool = False,
                 recompute: str = "none"):
        super().__init__()
        if recompute not in ("none", "selective", "full"):
            raise ValueError(f"llm.layout.recompute={recompute!r}: use none, selective or full")
        self.full_recompute = recompute == "full"
        sync = tp_group if sequence_parallel else None
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, grad_sync_group=sync)
        self.attn = Attention(cfg, tp_group, sequence_parallel, recompute == "selective")
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, grad_sync_group=sync)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size, tp_group, sequence_parallel)

    def forward(self, x, rope, attend):
        """x [T, H]; rope (cos, sin) and attend: see `Attention.forward`."""
        if self.full_recompute and torch.is_grad_enabled():
            return checkpoint(self._block, x, rope, attend, use_reentrant=False)
        return self._block(x, rope, attend)

    def _block(self, x, rope, attend):
        x = x + self.attn(self.attn_norm(x), rope, attend)
        return x + self.mlp(self.mlp_norm(x))


class Layers(nn.ModuleDict):
    """Decoder layers keyed by their GLOBAL index (FQN `layers.{i}` on any pipeline stage);
    indexed with an int and iterated over the layers in order, like a ModuleList."""

    def __getitem__(self, index) -> nn.Module:
        return super().__getitem__(str(index))

    def __iter__(self):
        return iter(self._modules.values())


class LlamaDecoder(nn.Module):
    """Token embedding, decoder layers, final norm and LM head (untied unless
    `cfg.tie_embeddings`), or one pipeline stage's part of them (`stage`).

    `cp_comm`, `sequence_parallel` and `recompute` default to `cfg.layout`'s values; sequence
    parallelism is off when the TP size is 1. `attention_backend`: the run's backend, resolved
    once by the caller from its device, compute dtype and largest CP group
    (`hcp.model.backends.resolve_backend`); None resolves `cfg.attention_backend` for fp32 on
    CPU. A micro-batch on a CP group of more than one rank runs hcp's CP attention whatever the
    backend (the CP x backend rule is checked at build time, never per micro-batch). Raises
    ValueError for sizes that do not split over TP, for tied embeddings split over several
    stages (the table would live on two stages), and for a GPU backend with `cp_group`.
    """

    def __init__(self, cfg: LLMArch, tp_group=None, cp_group=None, cp_comm: str | None = None,
                 sequence_parallel: bool | None = None, stage: StageSpec | None = None,
                 recompute: str | None = None, attention_backend: str | None = None):
        super().__init__()
        self.cfg, self.tp_group, self.cp_group = cfg, tp_group, cp_group
        self.stage = stage or StageSpec.whole(cfg.num_layers)
        if cfg.tie_embeddings and self.stage.num_stages > 1:
            raise ValueError("llm.tie_embeddings=true with pipeline stages: the embedding (first "
                             "stage) and the LM head (last stage) cannot share one table; untie "
                             "them")
        recompute = cfg.layout.recompute if recompute is None else recompute
        self.cp_comm = cfg.layout.cp_comm if cp_comm is None else cp_comm
        sp = cfg.layout.sequence_parallel if sequence_parallel is None else sequence_parallel
        self.sequence_parallel = sp and group_size(tp_group) > 1
        self.attention_backend = resolve_backend(attention_backend or cfg.attention_backend,
                                                 # te/flash missing: fails here
                                                 cp=group_size(cp_group))
        self._attention = attention_fn(self.attention_backend)
        self.cp_attention = cp_attention_for(self.attention_backend, self.cp_comm)
        self._check_cp(cp_group)
        sp = self.sequence_parallel
        first, last = self.stage.first, self.stage.last
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_group)
                             if first else None)
        self.layers = Layers({str(i): DecoderLayer(cfg, tp_group, sp, recompute)
                              for i in range(self.stage.start, self.stage.stop)})
        self.norm = (RMSNorm(cfg.hidden_size, cfg.norm_eps,
                             grad_sync_group=tp_group if sp else None)
                     if last else None)
        self.lm_head = None if cfg.tie_embeddings or not last else ColumnParallelLinear(
            cfg.hidden_size, cfg.vocab_size, bias=False, tp_group=tp_group)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: long [T] -> [T, H]."""
        return self.embed_tokens(input_ids)

    def _check_cp(self, cp_group) -> None:
        if self.cp_attention is None and group_size(cp_group) > 1:
            raise ValueError(f"llm.attention_backend={self.attention_backend} does not run with "
                             "CP: use llm.attention_backend=torch (or auto, or te)")

    def _attend(self, num_tokens: int, cu_seqlens: torch.Tensor, max_seqlen: int, cp_group,
                seqlens=None):
        """Attention over the first `num_tokens` rows (later rows are SP padding: zeros out)."""
        if group_size(cp_group) > 1:
            host = cu_seqlens if seqlens is None else cu_of(seqlens)
            core = self.cp_attention(host, cp_group, cu_seqlens.device)
        else:
            # it splits by host lengths: known once for every layer
            if self.attention_backend == "torch":
                seqlens = host_seqlens(cu_seqlens, seqlens)
            core = lambda q, k, v: self._attention(  # noqa: E731
                q, k, v, cu_seqlens, max_seqlen, seqlens)
        pad = self._sp_pad(num_tokens)
        if not pad:
            return core

        def attend(q, k, v):
            return F.pad(core(q[:num_tokens], k[:num_tokens], v[:num_tokens]), (0, 0, 0, 0, 0, pad))
        return attend

    def _sp_pad(self, t: int) -> int:
        return -t % group_size(self.tp_group) if self.sequence_parallel else 0

    def enter(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """First stage: [T, H] -> the residual stream [T, H] (SP: this TP rank's [(T + pad) / tp,
        H])."""
        if not self.sequence_parallel:
            return inputs_embeds
        return split_seq(F.pad(inputs_embeds, (0, 0, 0, self._sp_pad(inputs_embeds.shape[0]))),
                         self.tp_group)

    def run_layers(self, x: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                   max_seqlen: int, cp_group=_DECODER_GROUP, seqlens=None) -> torch.Tensor:
        """This stage's layers over the residual stream x (see `enter`); position_ids long [T]
        (this rank's T tokens before the SP split). `cp_group`: this micro-batch's CP group
        (default: the decoder's `cp_group`; dynamic CP passes one per micro-batch). `seqlens`:
        the document lengths on the host (the step plan's; None: read from cu_seqlens once).
        The RoPE tables and the attention plan are built here, once per micro-batch, for every
        layer. Returns the same shape as x."""
        t = position_ids.shape[0]
        cp_group = self.cp_group if cp_group is _DECODER_GROUP else cp_group
        self._check_cp(cp_group)
        attend = self._attend(t, cu_seqlens, max_seqlen, cp_group, seqlens)
        kind = x.device.type   # q and k come out of the projections in autocast's dtype
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        rope = rope_tables(F.pad(position_ids, (0, self._sp_pad(t))), self.cfg.hidden_size //
                           self.cfg.num_heads, self.cfg.rope_theta, dtype)
        for layer in self.layers:
            x = layer(x, rope, attend)
        return x

    def exit(self, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Last stage: final norm of the residual stream -> hidden states [num_tokens, H]."""
        x = self.norm(x)
        if not self.sequence_parallel:
            return x
        # every TP rank consumes the whole gathered sequence (the LM head copies it into the TP
        # region), so each rank's slice gets its full gradient back: backward keeps the slice
        return gather_from_group(x, self.tp_group, dim=0)[:num_tokens]

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen: int, seqlens=None) -> torch.Tensor:
        """Whole model: inputs_embeds [T, H], position_ids long [T] (restarting per document),
        cu_seqlens int32 [N + 1], max_seqlen int -> final-normed hidden states [T, H]. Under CP,
        T is this rank's shard while cu_seqlens / max_seqlen describe the whole micro-batch
        (`seqlens`: see `run_layers`)."""
        x = self.run_layers(self.enter(inputs_embeds), position_ids, cu_seqlens, max_seqlen,
                            seqlens=seqlens)
        return self.exit(x, inputs_embeds.shape[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> logits [T, V / tp] (this TP rank's vocabulary slice)."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return F.linear(copy_to_group(hidden, self.tp_group), self.embed_tokens.weight)
