"""Causal attention over packed documents (THD), pure torch: the CPU reference backend.

Layout: `q [T, Hq, D]`, `k, v [T, Hkv, D]` with `Hq` a multiple of `Hkv` (grouped-query
attention), `cu_seqlens` int32 `[N + 1]` (prefix sums of the N document lengths) and
`max_seqlen` (the longest document). Each token attends causally to earlier tokens of its own
document only. The documents are scattered into a padded `[N, S, H, D]` batch and run through
`F.scaled_dot_product_attention` with a boolean mask (causal AND key-is-real), then gathered
back, so values and gradients are exact (padding slots get zero gradient).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def doc_slots(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Document index and offset within the document of every token.

    cu_seqlens: int [N + 1]. Returns (doc [T], slot [T]), both int64.
    """
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)
    slot = torch.arange(int(cu[-1]), device=cu.device) - cu[doc]
    return doc, slot


def to_padded(x: torch.Tensor, doc: torch.Tensor, slot: torch.Tensor, num_docs: int,
              max_len: int) -> torch.Tensor:
    """Scatter tokens x [T, H, D] into [N, H, S, D] (zeros where a document is shorter)."""
    out = x.new_zeros(num_docs, max_len, *x.shape[1:])
    return out.index_put((doc, slot), x).transpose(1, 2)


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """SDPA on padded batches with grouped-query heads.

    q: [N, Hq, Sq, D]; k, v: [N, Hkv, Sk, D]; mask: bool [N, 1, Sq, Sk] (True = attend).
    A row with no True entry returns zeros. Returns [N, Hq, Sq, D].
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          enable_gqa=q.shape[1] != k.shape[1])


def thd_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """Causal attention within each document. Shapes in the module docstring; returns
    [T, Hq, D].

    Raises:
        ValueError: Hq is not a multiple of Hkv, or the token counts disagree with cu_seqlens.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if not q.shape[0] == k.shape[0] == int(cu_seqlens[-1]):
        raise ValueError(f"q has {q.shape[0]} tokens, k {k.shape[0]}, cu_seqlens[-1] = "
                         f"{int(cu_seqlens[-1])}: they must be equal")
    doc, slot = doc_slots(cu_seqlens)
    num_docs = len(cu_seqlens) - 1
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ar = torch.arange(max_seqlen, device=q.device)
    causal = ar[None, :] <= ar[:, None]                                   # [S, S]
    key_real = ar[None, :] < lengths[:, None]                             # [N, S]
    mask = (causal[None] & key_real[:, None, :])[:, None]                 # [N, 1, S, S]
    qp, kp, vp = (to_padded(t, doc, slot, num_docs, max_seqlen) for t in (q, k, v))
    out = padded_attention(qp, kp, vp, mask).transpose(1, 2)              # [N, S, Hq, D]
    return out[doc, slot]
