"""One pipeline stage of an encoder island (placement=non_colocated, DESIGN.md 4.4).

An encoder island runs an encoder (a ViT) with its projector under the encoder's own TP, DP
and PP. Stage s holds the encoder's blocks [start, stop) (`hcp.model.vit.ViTEncoder` with a
`StageSpec`; the first stage also holds the embeddings and reads pixel values); the last stage
also holds the projector and returns the image rows [I * P, H_llm] that the island route
(`hcp.comm.island`) sends to the LLM's first stage. FQNs equal the single-process model's
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
from hcp.model.projector import Projector
from hcp.model.stage import StageSpec
from hcp.model.vit import ViTEncoder


class EncoderStage(nn.Module):
    """Stage `stage` of the encoder `name` (its config `enc_cfg`) and, on the last stage, its
    projector `projector_name` (config `projector_cfg`, None: the encoder's output is the row).

    forward(x): x is pixel values [I, C, H, W] on the first stage, else the previous stage's
    hidden states [I, P + 1, D]; returns hidden states [I, P + 1, D] (not last) or image rows
    [I * P, H_llm] (last).
    """

    def __init__(self, name: str, enc_cfg, projector_cfg, llm_hidden: int, stage: StageSpec,
                 tp_group=None, projector_name: str = "projector"):
        super().__init__()
        self.name, self.projector_name, self.stage, self.tp_group = name, projector_name, stage, tp_group
        self.hidden_size = enc_cfg.hidden_size
        setattr(self, name, ViTEncoder(enc_cfg, tp_group, stage))
        if stage.last and projector_cfg is not None:
            setattr(self, projector_name, Projector(projector_cfg, enc_cfg.hidden_size, llm_hidden, tp_group))

    @property
    def encoder(self) -> ViTEncoder:
        return getattr(self, self.name)

    def activation_shape(self, images: int) -> tuple[int, int, int]:
        """[I, P + 1, D]: the hidden states a non-last stage sends for `images` images."""
        return images, self.encoder.num_patches + 1, self.hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        if not self.stage.last:
            return h
        projector = getattr(self, self.projector_name, None)
        feats = projector(h) if projector is not None else h
        return copy_to_group(feats.reshape(-1, feats.shape[-1]), self.tp_group)
