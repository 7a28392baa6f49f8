"""One pipeline stage of an encoder island (placement=non_colocated, docs/design.md 4.4).

An encoder island runs an encoder (a ViT) with its projector(s) under the encoder's own TP, DP
and PP. Stage s holds the encoder's blocks [start, stop) (`hcp.model.vit.ViTEncoder` with a
`StageSpec`; the first stage also holds the embeddings and reads pixel values); the last stage
also holds the projectors (one per stream the encoder feeds: two under a branch) and returns
the image rows of every stream, which the island routes (`hcp.comm.island`, one per stream)
send to the LLM's first stage. FQNs equal the single-process model's
(`vision.blocks.1.*`, `projector.*`), so `init_parameters(stage, seed)` gives the same weights
and checkpoints are keyed by module FQN whatever the layout.

As in `hcp.model.llava.LlavaEncoder`, the rows pass through Megatron's copy-to-TP-region
(identity forward, gradient all-reduced over the encoder's TP group backward): each row leaves
from one TP replica and its gradient returns there only.
"""
from __future__ import annotations

import torch
from torch import nn

from hcp.model.collectives import copy_to_group
from hcp.model.encoder_types import build_encoder
from hcp.model.projector import Projector
from hcp.model.stage import StageSpec


class EncoderStage(nn.Module):
    """Stage `stage` of the encoder `name` (its config `enc_cfg`) and, on the last stage, the
    projectors it feeds on its island (`projectors`: name -> ProjectorArch, in stream order;
    {}: the encoder's output is the row). Several projectors are a branch: the tower runs once
    per micro-batch, each projector reads its features, and the tower's gradient is the sum of
    theirs (autograd inside the stage).

    `recompute`: the encoder's blocks recompute their forward in backward (`ViTEncoder`).
    `cp_group`: the encoder's CP group (`ViTEncoder`): stages pass [I, k, D] chunks and the last
    returns this CP rank's rows of each input.

    forward(x): x is pixel values [I, C, H, W] on the first stage, else the previous stage's
    hidden states [I, P + 1, D]; returns hidden states [I, P + 1, D] (not last) or the rows of
    every stream, concatenated in stream order, [sum_s I * R_s, H_llm] (last; the island's link,
    `hcp.schedule.links.StreamsLink`, cuts them by stream with the plan's rows).
    """

    def __init__(self, name: str, enc_cfg, projectors: dict, llm_hidden: int, stage: StageSpec,
                 tp_group=None, recompute: bool = False, cp_group=None):
        super().__init__()
        self.name, self.stage, self.tp_group = name, stage, tp_group
        self.projector_names = tuple(projectors) if stage.last else ()
        self.hidden_size = enc_cfg.hidden_size
        setattr(self, name, build_encoder(enc_cfg, tp_group, stage, recompute, cp_group))
        for p in self.projector_names:
            setattr(self, p, Projector(projectors[p], enc_cfg.hidden_size, llm_hidden, tp_group))

    @property
    def encoder(self) -> nn.Module:
        return getattr(self, self.name)

    def activation_shape(self, images: int) -> tuple[int, int, int]:
        """[I, k, D]: the hidden states a non-last stage sends for `images` images (k = P + 1, or
        this CP rank's chunk under encoder CP)."""
        return images, self.encoder.local_tokens, self.hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        if not self.stage.last:
            return h
        outs = [getattr(self, p)(h) for p in self.projector_names] or [h]
        feats = torch.cat([o.reshape(-1, o.shape[-1]) for o in outs])
        return copy_to_group(feats, self.tp_group)
