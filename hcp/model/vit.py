"""ViT image encoder, CLIP-style (Radford et al. 2021; Dosovitskiy et al. 2020): bias-free linear
patch embedding, a CLS token, learned position embeddings, a pre-LayerNorm, pre-norm blocks with
bidirectional attention and a GELU MLP (quick-GELU under `arch: clip`, hcp/model/encoder_types.py:
then it computes what transformers' CLIPVisionModel does). `select_layer` picks the hidden state
fed to the projector (-1 last, -2 penultimate); only the blocks feeding it are built.

Tensor parallelism over `tp_group` (Megatron-LM): q/k/v and fc1 column-parallel, o_proj and fc2
row-parallel; parameter names and whole shapes are the unsharded model's, so init and checkpoints
do not depend on the TP size. Pipeline stages (`stage`): stage s holds blocks [start, stop) under
their global indices; later stages take hidden states [I, P + 1, D]; the last drops the CLS token.
Context parallelism over `cp_group`: each input's P + 1 tokens are cut into chunks of
k = ceil((P + 1) / cp), one per CP rank (`hcp.parallel.encoder_cp`); a rank carries [I, k, D] and
attends its queries to all-gathered keys (`hcp.model.cp_attention`); the last stage returns this
rank's rows [I, n_r, D]; weight gradients are partial sums over the encoder's DP x CP group."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hcp.config.specs import EncoderArch
from hcp.model.collectives import group_rank, group_size
from hcp.model.cp_attention import CPAttentionPlan, Call, Rows, Segments, cp_attention
from hcp.model.cp_kernels import fused_kernel
from hcp.model.tp import ColumnParallelLinear, RowParallelLinear
from hcp.parallel import encoder_cp


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation: `x * sigmoid(1.702 x)` (Radford et al. 2021)."""
    return x * torch.sigmoid(1.702 * x)


class VisionBlock(nn.Module):
    """Pre-norm block: `x + attn(ln1(x))`, `x + fc2(act(fc1(ln2(x))))` (act: GELU, or quick-GELU
    for `arch: clip`). x: [I, S, D]
    (replicated over `tp_group`; each TP rank runs num_heads / tp heads and ffn / tp columns).

    Raises ValueError when hidden_size does not split into num_heads, or num_heads or
    ffn_hidden_size does not split over the TP size."""

    def __init__(self, cfg: EncoderArch, tp_group=None, act=F.gelu):
        super().__init__()
        d, tp = cfg.hidden_size, group_size(tp_group)
        if d % cfg.num_heads:
            raise ValueError(f"vision: hidden_size {d} must be divisible by num_heads "
                             f"{cfg.num_heads}")
        if cfg.num_heads % tp or cfg.ffn_hidden_size % tp:
            raise ValueError(f"vision.layout.tp={tp} must divide vision.num_heads={cfg.num_heads} "
                             f"and vision.ffn_hidden_size={cfg.ffn_hidden_size}: pick a TP size "
                             "that divides both")
        self.local_heads, self.head_dim = cfg.num_heads // tp, d // cfg.num_heads
        par = dict(bias=True, tp_group=tp_group)
        self.ln1 = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.q_proj, self.k_proj, self.v_proj = (ColumnParallelLinear(d, d, **par)
                                                 for _ in range(3))
        self.o_proj = RowParallelLinear(d, d, **par)
        self.ln2 = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.fc1 = ColumnParallelLinear(d, cfg.ffn_hidden_size, **par)
        self.fc2 = RowParallelLinear(cfg.ffn_hidden_size, d, **par)
        self.act = act

    def _attn(self, x: torch.Tensor, cp_plan: CPAttentionPlan | None) -> torch.Tensor:
        i, s, _ = x.shape
        if cp_plan is not None:  # this rank's chunk of every input against all of its keys
            q, k, v = (p(x).reshape(i * s, self.local_heads, self.head_dim)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            out = cp_attention(q, k, v, cp_plan).view(i, s, -1)
            return self.o_proj(out)
        q, k, v = (p(x).view(i, s, self.local_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)                    # [I, heads / tp, S, Dh]
        return self.o_proj(out.transpose(1, 2).reshape(i, s, self.local_heads * self.head_dim))

    def forward(self, x: torch.Tensor, cp_plan: CPAttentionPlan | None = None) -> torch.Tensor:
        """x [I, S, D]; `cp_plan`: the encoder's CP attention of this forward (None: no CP)."""
        x = x + self._attn(self.ln1(x), cp_plan)
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class ViTEncoder(nn.Module):
    """pixel_values [I, C, H, W] (H = W = image_size) -> patch features [I, P, D], with
    P = (image_size / patch_size)^2 (the CLS token is dropped from the output). `tp_group`:
    the blocks' TP group (module docstring); the output is whole on every TP rank.
    `recompute`: full per-block recompute (`torch.utils.checkpoint`, non-reentrant): each block
    keeps only its input [I, P + 1, D] and runs its forward again during its backward (an
    encoder island's `layout.recompute=full`; the colocated schedule recomputes the whole
    encoder side in its phase 3 instead). `cp_group`: the encoder's CP group (module docstring);
    under CP the output is this rank's rows of each input [I, n_r, D] (`local_tokens` = k).
    `act`: the MLP's activation (the `arch`'s, chosen by
    `hcp.model.encoder_types.build_encoder`)."""

    def __init__(self, cfg: EncoderArch, tp_group=None, stage=None, recompute: bool = False,
                 cp_group=None, act=F.gelu):
        super().__init__()
        self.recompute, self.cp_group = recompute, cp_group
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"vision: image_size {cfg.image_size} must be a multiple of "
                             f"patch_size {cfg.patch_size}")
        if not -cfg.num_layers <= cfg.select_layer < 0:
            raise ValueError(f"vision: select_layer {cfg.select_layer} must be in "
                             f"[-{cfg.num_layers}, -1]")
        self.cfg, self.stage = cfg, stage
        self.num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.cp, self.cp_rank = group_size(cp_group), group_rank(cp_group)
        tokens = self.num_patches + encoder_cp.LEAD
        self.local_tokens = encoder_cp.chunk(tokens, self.cp)
        self._first_position = int(encoder_cp.positions(tokens, self.cp, self.cp_rank)[0])
        self._out = encoder_cp.output_range(self.num_patches, self.cp, self.cp_rank)
        d = cfg.hidden_size
        if stage is None or stage.first:
            self.patch_embed = nn.Linear(cfg.num_channels * cfg.patch_size ** 2, d, bias=False)
            self.class_embedding = nn.Parameter(torch.zeros(d))
            self.position_embedding = nn.Parameter(torch.zeros(self.num_patches + 1, d))
            self.pre_norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        used = cfg.num_layers + cfg.select_layer + 1
        if stage is None:
            self.blocks = nn.ModuleList(VisionBlock(cfg, tp_group, act) for _ in range(used))
        else:
            self.blocks = nn.ModuleDict({str(i): VisionBlock(cfg, tp_group, act)
                                         for i in range(stage.start, stage.stop)})

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: images, or on a later pipeline stage the hidden states [I, P + 1, D].
        Returns [I, P, D], or on a non-last stage the hidden states [I, P + 1, D].
        Raises ValueError when the images are not [I, num_channels, image_size, image_size]."""
        if self.stage is not None and not self.stage.first:
            return self._blocks(pixel_values)
        c, s, p = self.cfg.num_channels, self.cfg.image_size, self.cfg.patch_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (c, s, s):
            raise ValueError(f"vision: pixel_values must be [I, {c}, {s}, {s}], "
                             f"got {list(pixel_values.shape)}")
        i = pixel_values.shape[0]
        patches = pixel_values.unfold(2, p, p).unfold(3, p, p)          # [I, C, s/p, s/p, p, p]
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(i, self.num_patches, c * p * p)
        if self.cp > 1:
            return self._blocks(self._embed_chunk(patches))
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype))
        cls = self.class_embedding.expand(i, 1, -1)
        x = self.pre_norm(torch.cat([cls, x], dim=1) + self.position_embedding)
        return self._blocks(x)

    def _embed_chunk(self, patches: torch.Tensor) -> torch.Tensor:
        """This CP rank's k positions of every input [I, k, D] from all patches [I, P, C*p*p]:
        position 0 is the CLS token, padding positions repeat the last token (never a key, their
        rows never returned)."""
        pos = torch.arange(self._first_position, self._first_position + self.local_tokens,
                           device=patches.device).clamp_(max=self.num_patches)
        x = self.patch_embed(patches[:, (pos - 1).clamp(min=0)].to(self.patch_embed.weight.dtype))
        x = torch.where((pos == 0)[None, :, None], self.class_embedding.to(x.dtype), x)
        return self.pre_norm(x + self.position_embedding[pos])

    def cp_plan(self, images: int, device) -> CPAttentionPlan | None:
        """The CP attention of one forward over `images` inputs (None without CP, or with no
        input: then every rank of the CP group, which encodes the same inputs, skips it): one
        fused call of each input's k local queries against its P + 1 keys in the all-gathered
        K/V (rank-major: rank s's k rows of input i at s*I*k + i*k)."""
        if self.cp == 1 or images == 0:
            return None
        k, tokens = self.local_tokens, self.num_patches + encoder_cp.LEAD
        t = np.arange(tokens)
        keys = (t // k)[None] * images * k + np.arange(images)[:, None] * k + (t % k)[None]
        queries = np.arange(images * k).reshape(images, k)
        kernel = fused_kernel(device)
        rows = (lambda r: Segments.of([r], device)) if kernel.ragged else (
            lambda r: Rows.of(r, device))  # a ragged kernel (CUDA) takes flat blocks
        call = Call(rows(queries), rows(keys), causal=False, first=True)
        return CPAttentionPlan(self.cp_group, "allgather", [[call]], kernel)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks
        plan = self.cp_plan(x.shape[0], x.device)
        for block in blocks:
            x = (checkpoint(block, x, plan, use_reentrant=False) if self.recompute
                 and torch.is_grad_enabled()
                 else block(x, plan))
        if self.stage is not None and not self.stage.last:
            return x
        # a copy, not a view: under FSDP (`vision.layout.dp_shard`) the module's output carries
        # its pre-backward hook, which an in-place op on a view would drop
        return x[:, self._out[0]:self._out[1]].clone()
