"""Causal THD attention across context-parallel ranks (head-tail shards of
`hcp.parallel.cp_sharding`), block-wise, exact in values and gradients.

Two strategies (`cp_comm`), as Transformer Engine / torch users know them:
- `allgather` (default): all-gather K/V of the CP group once, attend the local queries to the
  keys block by block, and reduce-scatter the K/V gradients back to their owners (the all-gather
  CP of Llama 3 / Megatron-LM `cp_comm_type=all_gather`).
- `p2p`: ring attention (Liu et al. 2023; Transformer Engine's `p2p` CP): K/V shards rotate
  around the ring with `batch_isend_irecv` while the current shard's blocks are computed, folded
  into one online softmax. The backward rotates K/V again together with their fp32 gradient
  accumulators, which reach their owners after one more hop.

Both run the tiles of `hcp.model.block_attention` (fp32 running max, sum and output, flash
backward). The tiles come from positions alone: CP size c cuts a document of L tokens into 2c
chunks of k = ceil(L / 2c) positions, chunk i owned by rank min(i, 2c-1-i), stored in the
owner's local rows as [head chunk, tail chunk]. A query in chunk i sees the whole chunks before i
and the causal diagonal of chunk i; every later chunk is skipped, which the head-tail split
balances (each rank computes the same number of tiles). Long documents are cut into blocks of
`block_size` positions: full tiles need no mask, diagonal tiles share one `tril` mask. A short
document (its whole local query x key tile within block_size^2) is one tile with a position mask;
documents with the same k share that mask and run as one batch. The memory of a call is the
(gathered or in-flight) K/V plus O(block_size^2 x heads).

The CP group is an argument of each micro-batch's plan (dynamic CP gives every micro-batch its
own group), never of a layer.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hcp.config.layouts import CP_COMMS
from hcp.model.block_attention import (BlockAttention, SoftmaxState, TileBatch, acc_dtype,
                                       backward_tiles, forward_tiles)
from hcp.model.collectives import gather_seq, group_rank, group_size

BLOCK_SIZE = 512

@dataclass
class CPAttentionPlan:
    """Per micro-batch tiles shared by all layers of one rank."""

    group: object
    comm: str
    tiles: list[list[TileBatch]]
    """allgather: one list, rows index the gathered K/V (rank-major, each rank's local rows);
    p2p: tiles[j] index the K/V shard of rank j (its local rows)."""


class _Collector:
    """Tiles grouped by (shape, mask key) into TileBatches."""

    def __init__(self):
        self.rows: dict = defaultdict(lambda: ([], []))
        self.masks: dict = {}

    def add(self, key, q_rows: torch.Tensor, k_rows: torch.Tensor, mask) -> None:
        """q_rows [n, bq], k_rows [n, bk] sharing `mask` (None or bool [bq, bk]) under `key`."""
        qs, ks = self.rows[key]
        qs.append(q_rows)
        ks.append(k_rows)
        self.masks[key] = mask

    def batches(self) -> list[TileBatch]:
        return [TileBatch(torch.cat(qs), torch.cat(ks), self.masks[key])
                for key, (qs, ks) in self.rows.items()]


def _chunk_positions(chunks, k: int) -> torch.Tensor:
    return torch.cat([i * k + torch.arange(k) for i in chunks])


def _short_docs(col: dict, starts: torch.Tensor, k: int, c: int, r: int, t_loc: int, comm: str):
    """Documents of chunk size k (local rows starting at `starts` [n]) that fit one tile each:
    all local rows against all key rows, masked by position (one mask for the n documents)."""
    q_rows = starts[:, None] + torch.arange(2 * k)                               # [n, 2k]
    q_pos = _chunk_positions((r, 2 * c - 1 - r), k)
    own = [_chunk_positions((j, 2 * c - 1 - j), k) for j in range(c)]     # positions by rank
    if comm == "allgather":
        offsets = (torch.arange(c)[:, None] * t_loc + torch.arange(2 * k)).flatten()
        mask = torch.cat(own)[None, :] <= q_pos[:, None]
        col[0].add(("short", k), q_rows, starts[:, None] + offsets, mask)  # k_rows [n, 2ck]
        return
    for j in range(c):
        mask = own[j][None, :] <= q_pos[:, None]
        if mask.any():
            col[j].add(("short", k), q_rows, q_rows, mask)


def _long_doc(col: dict, start: int, k: int, c: int, r: int, t_loc: int, comm: str, block: int):
    """Block tiles of one long document: full blocks before each query block, its diagonal."""
    def blocks(stop):
        return [(o, min(block, stop - o)) for o in range(0, stop, block)]

    for chunk, q_off in ((r, 0), (2 * c - 1 - r, k)):
        for o, b in blocks(k):
            q_rows = start + q_off + o + torch.arange(b)
            for i in range(chunk + 1):
                owner = min(i, 2 * c - 1 - i)
                base = (owner * t_loc if comm == "allgather" else 0) + start + (0 if i < c else k)
                target = col[0 if comm == "allgather" else owner]
                for ko, kb in blocks(k if i < chunk else o):
                    target.add(("full", b, kb), q_rows[None], (base + ko + torch.arange(kb))[None], None)
                if i == chunk:
                    target.add(("diag", b), q_rows[None], (base + o + torch.arange(b))[None],
                               torch.ones(b, b, dtype=torch.bool).tril())


def cp_tiles(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, comm: str = "allgather",
             block_size: int = BLOCK_SIZE) -> list[list[TileBatch]]:
    """The tiles of CP rank `cp_rank` of `cp_size` (see `CPAttentionPlan.tiles`) for the whole
    micro-batch's cu_seqlens (int [N + 1]); indices on cu_seqlens' device. Pure function.

    Raises ValueError for an unknown `comm` or a block_size < 1.
    """
    if comm not in CP_COMMS:
        raise ValueError(f"cp_comm={comm!r} is unknown: use one of {CP_COMMS}")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    c, r = cp_size, cp_rank
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().cpu()
    chunk = (lengths + 2 * c - 1) // (2 * c)                                     # k per document
    starts = torch.cumsum(2 * chunk, 0) - 2 * chunk                               # local rows
    t_loc = int(2 * chunk.sum())
    col = {j: _Collector() for j in range(c if comm == "p2p" else 1)}
    short = (2 * chunk) * (2 * c * chunk) <= block_size * block_size
    for k in chunk[short & (chunk > 0)].unique().tolist():
        _short_docs(col, starts[short & (chunk == k)], k, c, r, t_loc, comm)
    for d in (~short).nonzero().flatten().tolist():
        _long_doc(col, int(starts[d]), int(chunk[d]), c, r, t_loc, comm, block_size)
    device = cu_seqlens.device
    return [[TileBatch(b.q_rows.to(device), b.k_rows.to(device),
                       None if b.mask is None else b.mask.to(device)) for b in col[j].batches()]
            for j in sorted(col)]


def build_cp_plan(cu_seqlens: torch.Tensor, group, comm: str = "allgather",
                  block_size: int = BLOCK_SIZE) -> CPAttentionPlan:
    """Plan for this rank of `group` (the micro-batch's CP group; None = size 1) from the whole
    micro-batch's cu_seqlens (int32 [N + 1]). Raises ValueError as `cp_tiles`."""
    return CPAttentionPlan(group, comm, cp_tiles(cu_seqlens, group_size(group), group_rank(group),
                                                 comm, block_size))


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 plan: CPAttentionPlan) -> torch.Tensor:
    """Local queries q [T_loc, Hq, D] attend to the keys/values k, v [T_loc, Hkv, D] of every
    CP rank of `plan.group`. Returns [T_loc, Hq, D] in q's dtype."""
    if plan.comm == "allgather":
        kv = gather_seq(torch.stack([k, v], dim=1), plan.group)           # [c * T_loc, 2, Hkv, D]
        return BlockAttention.apply(q, kv[:, 0], kv[:, 1], plan.tiles[0])
    return _RingAttention.apply(q, k, v, plan)


def _ring_shift(x: torch.Tensor, group, tag: int):
    """Start sending x to the next rank and receiving the previous rank's tensor of the same
    shape. Returns (receive buffer, requests to wait on)."""
    size, rank = group_size(group), group_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    recv = torch.empty_like(x)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt, group, tag),
                                   dist.P2POp(dist.irecv, recv, prv, group, tag)])
    return recv, reqs


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


class _RingAttention(torch.autograd.Function):
    """Ring attention: q [T_loc, Hq, D], k, v [T_loc, Hkv, D] -> [T_loc, Hq, D]."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        group = plan.group
        size, rank = group_size(group), group_rank(group)
        state = SoftmaxState.empty(q)
        kv = torch.stack([k, v])
        for step in range(size):
            if step < size - 1:
                nxt_kv, reqs = _ring_shift(kv, group, tag=0)
            forward_tiles(state, q, kv[0], kv[1], plan.tiles[(rank - step) % size])
            if step < size - 1:
                _wait(reqs)
                kv = nxt_kv
        out, lse = state.result(q.dtype)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        group = plan.group
        size, rank = group_size(group), group_rank(group)
        acc = acc_dtype(q.dtype)
        delta = (dout.to(acc) * out.to(acc)).sum(-1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        for step in range(size):
            if step < size - 1:
                nxt_kv, kv_reqs = _ring_shift(kv, group, tag=0)
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            backward_tiles(q, kv[0], kv[1], dout, lse, delta, plan.tiles[(rank - step) % size],
                           dq, dkv[0], dkv[1])
            if step > 0:
                _wait(dkv_reqs)
                dkv += recv_dkv
            # the fp32 gradient travels with its K/V; one hop after the last step it is home
            recv_dkv, dkv_reqs = _ring_shift(dkv, group, tag=1)
            if step < size - 1:
                _wait(kv_reqs)
                kv = nxt_kv
        _wait(dkv_reqs)
        return dq.to(q.dtype), recv_dkv[0].to(k.dtype), recv_dkv[1].to(v.dtype), None
