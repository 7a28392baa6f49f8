"""Tiny randomly initialised transformers models saved locally (no download) for the
import/export tests, and the same micro-batch for hcp and transformers."""
from __future__ import annotations

import torch

LLAMA = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False)
CLIP = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            image_size=8, patch_size=2, num_channels=3, layer_norm_eps=1e-5)


def save_llama(folder, shard_size=None, seed=0, **kw):
    """A random LlamaForCausalLM (hidden 64, 2 layers, GQA 4/2 heads) saved as safetensors in
    `folder` (sharded with its index when `shard_size` is given, e.g. "60KB"); returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**LLAMA, **kw})).eval()
    with torch.no_grad():  # RMSNorm weights start at 1: make them matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, **({"max_shard_size": shard_size} if shard_size else {}))
    return model


def save_clip(folder, seed=0, **kw):
    """A random CLIPVisionModel (hidden 64, 3 blocks, 8x8 RGB images in 2x2 patches) saved in
    `folder`; returns it."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    model = CLIPVisionModel(CLIPVisionConfig(**{**CLIP, **kw})).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            if "class_embedding" in n or n.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    return model


def text_batch(lengths=(7, 12, 5), vocab=260, seed=1):
    """A THD micro-batch of random documents (`hcp.data.packing.Batch`) and the documents."""
    from hcp.data.llava import Sample
    from hcp.data.packing import collate

    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    samples = [Sample(str(i), d, d[1:] + [-100], [], 0, "") for i, d in enumerate(docs)]
    return collate(samples, [torch.zeros(0, 1, 1, 1)] * len(docs), image_token_id=-1), docs


@torch.no_grad()
def hf_logits(model, docs) -> torch.Tensor:
    """transformers' logits of each document run on its own, concatenated: [T, V]."""
    return torch.cat([model(torch.tensor([d])).logits[0] for d in docs])
