"""LLaVA-style model: ViT encoder -> projector -> LLaMA decoder over one THD micro-batch.

Submodules are named after the config keys (`vision`, `projector`, `llm`) so every FQN starts
with its module key: per-module freeze, optimizers and process groups select parameters by it.
With `vision_cfg=None` (and `projector_cfg=None`) it is a plain language model.

The micro-batch `batch` is any object with these attributes (shapes per micro-batch):
    input_ids     long [T]      token ids; ignored where image_mask is True
    labels        long [T]      ALREADY shifted targets (labels[t] is the target of position t),
                                -100 = ignore; never shifted again here
    position_ids  long [T]      restart at 0 in each document
    cu_seqlens    int32 [N + 1] document boundaries; max_seqlen: int
    pixel_values  float [I, C, H, W] or None (images in order of appearance)
    image_mask    bool [T] or None: positions replaced, in order, by the I * P image embeddings
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hcp.config.schema import LLMConfig, ProjectorConfig, VisionConfig
from hcp.model.llama import LlamaDecoder
from hcp.model.projector import Projector
from hcp.model.vit import ViTEncoder


class LlavaModel(nn.Module):
    def __init__(self, vision_cfg: VisionConfig | None, projector_cfg: ProjectorConfig | None,
                 llm_cfg: LLMConfig):
        """Raises ValueError when exactly one of vision_cfg / projector_cfg is given."""
        super().__init__()
        if (vision_cfg is None) != (projector_cfg is None):
            raise ValueError("vision and projector must be given together (or both None for a "
                             "text-only LM)")
        self.vision = ViTEncoder(vision_cfg) if vision_cfg is not None else None
        self.projector = (Projector(projector_cfg, vision_cfg.hidden_size, llm_cfg.hidden_size)
                          if projector_cfg is not None else None)
        self.llm = LlamaDecoder(llm_cfg)

    def embed(self, batch) -> torch.Tensor:
        """Text embeddings with the image embeddings written over the image positions: [T, H].

        Raises ValueError when image_mask's count is not I * P, or images reach a text-only model.
        """
        embeds = self.llm.embed(batch.input_ids)
        image_mask = getattr(batch, "image_mask", None)
        pixel_values = getattr(batch, "pixel_values", None)
        num_slots = int(image_mask.sum()) if image_mask is not None else 0
        if pixel_values is None or pixel_values.shape[0] == 0:
            if num_slots:
                raise ValueError(f"image_mask marks {num_slots} positions but the batch has no images")
            return embeds
        if self.vision is None:
            raise ValueError("the batch has pixel_values but the model has no vision encoder")
        feats = self.projector(self.vision(pixel_values))                # [I, P, H]
        feats = feats.reshape(-1, feats.shape[-1]).to(embeds.dtype)
        if num_slots != feats.shape[0]:
            raise ValueError(f"image_mask marks {num_slots} positions but {pixel_values.shape[0]} "
                             f"images x {self.vision.num_patches} patches = {feats.shape[0]} "
                             "image embeddings: they must be equal")
        return embeds.index_put((image_mask.nonzero().squeeze(1),), feats)

    def hidden(self, batch) -> torch.Tensor:
        """Final-normed decoder hidden states [T, H]."""
        return self.llm(self.embed(batch), batch.position_ids, batch.cu_seqlens, batch.max_seqlen)

    def forward(self, batch) -> tuple[torch.Tensor, int]:
        """Return (sum of token cross-entropies over labels != -100 as a 0-d fp32 tensor, number
        of those tokens). Not a mean: the trainer divides by the global token count."""
        hidden = self.hidden(batch)
        keep = batch.labels != -100
        logits = self.llm.logits(hidden[keep])
        loss_sum = F.cross_entropy(logits.float(), batch.labels[keep], reduction="sum")
        return loss_sum, int(keep.sum())

    def logits(self, batch) -> torch.Tensor:
        """Logits of every position [T, V] (greedy decoding reads the last one of a document)."""
        return self.llm.logits(self.hidden(batch))
