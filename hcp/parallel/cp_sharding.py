"""Context-parallel head-tail ("zigzag") sharding of packed documents (docs/design.md section 3).

Under CP size c every document (a `cu_seqlens` segment) is padded to a multiple of 2c tokens and
cut into 2c equal chunks; CP rank r holds chunks r and 2c-1-r, so every rank gets the same share
of causal-attention work (the zigzag load balance of Megatron-LM / Transformer Engine CP and of
ring-attention's striped variants). Every rank holds the same number of tokens of each document,
so the local `cu_seqlens` are the same on every rank.

Known value: cu_seqlens = [0, 8, 16], c = 2 -> rank 0 holds token indices [0,1,6,7,8,9,14,15],
rank 1 [2,3,4,5,10,11,12,13]. Padding slots are marked invalid (masked out of attention and loss,
never dropped): their `token_index` is 0 and their position continues past the document's end.
Pure functions of the host `cu_seqlens` (the step plan's; `host_cu_seqlens`), no process group
and no device-to-host read.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hcp.parallel.upload import upload


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


def cu_of(seqlens) -> np.ndarray:
    """cu_seqlens int64 [N + 1] of N document lengths (tokens) on the host."""
    return np.concatenate([[0], np.cumsum(np.asarray(seqlens, dtype=np.int64))])


def host_cu_seqlens(batch) -> np.ndarray:
    """A micro-batch's cu_seqlens int [N + 1] on the host: from `batch.seqlens` (the step plan's
    document lengths, kept by `Batch.to` and `StageMeta`), else `batch.cu_seqlens` when it is on
    the CPU.

    Raises:
        ValueError: only a device copy exists (reading it back would stall the device every
            micro-batch); the message names the attribute to set.
    """
    seqlens = getattr(batch, "seqlens", None)
    if seqlens is not None:
        return cu_of(seqlens)
    if batch.cu_seqlens.device.type == "cpu":
        return batch.cu_seqlens.numpy()
    raise ValueError(f"the micro-batch's cu_seqlens are on {batch.cu_seqlens.device} and it has no "
                     "host lengths: set batch.seqlens (the N document lengths) for CP")


def host_cu(cu_seqlens) -> np.ndarray:
    """cu_seqlens (numpy, list or CPU tensor [N + 1]) as int64 numpy.

    Raises:
        ValueError: a tensor on a device (reading it back would stall the device every
            micro-batch: pass the host copy, `host_cu_seqlens`).
    """
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type != "cpu":
        raise ValueError(f"cu_seqlens on {cu_seqlens.device}: CP sharding and plans take the host "
                         "copy (batch.seqlens, hcp.parallel.cp_sharding.host_cu_seqlens)")
    return np.asarray(cu_seqlens, dtype=np.int64)


def head_tail_chunks(lengths, cp_size: int) -> np.ndarray:
    """int64 [N]: k = ceil(L / 2c), the tokens of each head (and each tail) chunk a CP rank of
    `cp_size` holds of documents of `lengths` (host ints [N]); the rank holds 2k per document."""
    return (np.asarray(lengths, dtype=np.int64) + 2 * cp_size - 1) // (2 * cp_size)


def cp_shard(cu_seqlens, cp_size: int, cp_rank: int, device=None) -> CPShard:
    """Return rank `cp_rank`'s head-tail shard of the documents in `cu_seqlens` (host int
    [N + 1]: numpy, list or CPU tensor), its tensors on `device` (default CPU).

    Raises:
        ValueError: cp_size < 1, cp_rank outside [0, cp_size), or cu_seqlens on a device.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} must be in [0, cp_size={cp_size})")
    cu = host_cu(cu_seqlens)
    lengths = np.diff(cu)
    two_c = 2 * cp_size
    chunk = head_tail_chunks(lengths, cp_size)                            # [N]
    local_cu = np.concatenate([[0], np.cumsum(2 * chunk)])
    doc = np.repeat(np.arange(len(lengths)), 2 * chunk)
    slot = np.arange(local_cu[-1]) - local_cu[doc]
    k = chunk[doc]
    position = np.where(slot < k, cp_rank * k + slot, (two_c - 1 - cp_rank) * k + slot - k)
    valid = position < lengths[doc]
    padded_cu = np.concatenate([[0], np.cumsum(two_c * chunk)])

    def move(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return upload(x, device or "cpu", dtype)

    return CPShard(
        token_index=move(np.where(valid, cu[doc] + position, 0), torch.long),
        valid=move(valid, torch.bool),
        position_ids=move(position, torch.long),
        cu_seqlens=move(local_cu, torch.int32),
        max_seqlen=int(2 * chunk.max()) if len(chunk) else 0,
        cu_seqlens_padded=move(padded_cu, torch.int32),
    )
