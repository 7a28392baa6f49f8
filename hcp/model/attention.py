"""Causal attention over packed documents (THD), pure torch: the CPU reference backend.

Layout: `q [T, Hq, D]`, `k, v [T, Hkv, D]` with `Hq` a multiple of `Hkv` (grouped-query
attention), `cu_seqlens` int32 `[N + 1]` (prefix sums of the N document lengths) and
`max_seqlen` (the longest document). Each token attends causally to earlier tokens of its own
document only. Documents are grouped into length buckets (lengths in (2^(b-1), 2^b]), so padding
costs at most 2x even when one long document is packed with many short ones; each bucket is
scattered into a padded `[n, S, H, D]` batch and run through `F.scaled_dot_product_attention`
with a boolean mask (causal AND key-is-real), then gathered back, so values and gradients are
exact (padding slots get zero gradient).
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
    [T, Hq, D]. `max_seqlen` bounds the document lengths (flash/te size their kernels by it;
    here each bucket's padded length comes from its own documents).

    Raises:
        ValueError: Hq is not a multiple of Hkv, the token counts disagree with cu_seqlens, or a
            document is longer than max_seqlen.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if not q.shape[0] == k.shape[0] == int(cu_seqlens[-1]):
        raise ValueError(f"q has {q.shape[0]} tokens, k {k.shape[0]}, cu_seqlens[-1] = "
                         f"{int(cu_seqlens[-1])}: they must be equal")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    if len(lengths) and int(lengths.max()) > max_seqlen:
        raise ValueError(f"a document has {int(lengths.max())} tokens, more than max_seqlen={max_seqlen}")
    doc, slot = doc_slots(cu_seqlens)
    bucket = torch.ceil(torch.log2(lengths.clamp(min=1).double())).long()   # [N]
    out = q.new_zeros(q.shape)
    for b in bucket.unique().tolist():
        docs = (bucket == b).nonzero().squeeze(1)                            # [n]
        renumber = torch.full_like(bucket, -1).index_put((docs,), torch.arange(len(docs), device=docs.device))
        tokens = (renumber[doc] >= 0).nonzero().squeeze(1)
        bdoc, bslot = renumber[doc[tokens]], slot[tokens]
        blen = lengths[docs]
        size = int(blen.max())
        ar = torch.arange(size, device=q.device)
        causal = ar[None, :] <= ar[:, None]                                  # [S, S]
        mask = (causal[None] & (ar[None, :] < blen[:, None])[:, None, :])[:, None]  # [n, 1, S, S]
        qp, kp, vp = (to_padded(t[tokens], bdoc, bslot, len(docs), size) for t in (q, k, v))
        res = padded_attention(qp, kp, vp, mask).transpose(1, 2)            # [n, S, Hq, D]
        out = out.index_put((tokens,), res[bdoc, bslot])
    return out
