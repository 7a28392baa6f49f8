"""The encoder side made whole on one rank, for evaluation: greedy decoding re-encodes each
prompt's images inside the LLM's first stage, so the LLM's ranks need the whole encoder."""
from __future__ import annotations

import torch
import torch.distributed as dist

from hcp.model.llava import LlavaEncoder


def whole_encoder(encoder, cfg, device) -> LlavaEncoder | None:
    """The colocated encoder side (`LlavaEncoder`) whole on this rank: the training encoder itself
    under encoder tp = 1, else a copy whose TP shards are gathered over the encoder's TP group
    (a collective over it: every rank evaluates). None for a text-only LM."""
    if encoder is None or encoder.tp_group is None:
        return encoder
    group = encoder.tp_group
    whole = LlavaEncoder(cfg.vision, cfg.projector, cfg.llm.hidden_size).to(device)
    state = {}
    for name, p in encoder.named_parameters():
        spec = getattr(p, "shard_spec", None)
        if spec is None:
            state[name] = p.detach()
            continue
        parts = [torch.empty_like(p) for _ in range(spec.world)]
        dist.all_gather(parts, p.detach().contiguous(), group=group)
        state[name] = torch.cat(parts, dim=spec.dim)
    whole.load_state_dict(state)
    return whole
