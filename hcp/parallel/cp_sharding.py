"""Context-parallel head-tail ("zigzag") sharding of packed documents (docs/design.md section 3).

Under CP size c every document (a `cu_seqlens` segment) is padded to a multiple of 2c tokens and
cut into 2c equal chunks; CP rank r holds chunks r and 2c-1-r, so every rank gets the same share
of causal-attention work (the zigzag load balance of Megatron-LM / Transformer Engine CP and of
ring-attention's striped variants). Every rank holds the same number of tokens of each document,
so the local `cu_seqlens` are the same on every rank.

Known value: cu_seqlens = [0, 8, 16], c = 2 -> rank 0 holds token indices [0,1,6,7,8,9,14,15],
rank 1 [2,3,4,5,10,11,12,13]. Padding slots are marked invalid (masked out of attention and loss,
never dropped): their `token_index` is 0 and their position continues past the document's end.
Pure functions of `cu_seqlens`, no process group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CPShard:
    """One CP rank's tokens. T_loc = sum over documents of 2 * ceil(L / 2c)."""

    token_index: torch.Tensor
    """long [T_loc]: index of each local slot in the unsharded packed tokens (0 at padding)."""
    valid: torch.Tensor
    """bool [T_loc]: False at padding slots."""
    position_ids: torch.Tensor
    """long [T_loc]: position of each slot within its document (padding: >= its length)."""
    cu_seqlens: torch.Tensor
    """int32 [N + 1]: local document boundaries (identical on every CP rank)."""
    max_seqlen: int
    """Longest local document, in tokens."""
    cu_seqlens_padded: torch.Tensor
    """int32 [N + 1]: boundaries of the documents padded to multiples of 2c (whole sequence)."""


def cp_shard(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> CPShard:
    """Return rank `cp_rank`'s head-tail shard of the documents in `cu_seqlens` (int [N + 1]).

    Raises:
        ValueError: cp_size < 1 or cp_rank outside [0, cp_size).
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} must be in [0, cp_size={cp_size})")
    cu = cu_seqlens.long().cpu()
    lengths = cu[1:] - cu[:-1]
    two_c = 2 * cp_size
    chunk = (lengths + two_c - 1) // two_c                                 # [N]
    local_cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
    local_cu[1:] = torch.cumsum(2 * chunk, 0)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), 2 * chunk)
    slot = torch.arange(int(local_cu[-1])) - local_cu[doc]
    k = chunk[doc]
    head = slot < k
    position = torch.where(head, cp_rank * k + slot, (two_c - 1 - cp_rank) * k + slot - k)
    valid = position < lengths[doc]
    padded_cu = torch.zeros_like(local_cu)
    padded_cu[1:] = torch.cumsum(two_c * chunk, 0)
    device = cu_seqlens.device
    return CPShard(
        token_index=torch.where(valid, cu[doc] + position, 0).to(device),
        valid=valid.to(device),
        position_ids=position.to(device),
        cu_seqlens=local_cu.to(torch.int32).to(device),
        max_seqlen=int(2 * chunk.max()) if len(chunk) else 0,
        cu_seqlens_padded=padded_cu.to(torch.int32).to(device),
    )
