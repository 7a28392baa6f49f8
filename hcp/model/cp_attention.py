"""Causal THD attention across context-parallel ranks (head-tail shards of
`hcp.parallel.cp_sharding`), pure torch, exact in values and gradients.

Two strategies (`cp_comm`), as Transformer Engine / torch users know them:
- `allgather` (default): all-gather K/V of the CP group once, attend the local queries to all
  keys with a position mask, and reduce-scatter the K/V gradients back to their owners (the
  all-gather CP of Llama 3 / Megatron-LM `cp_comm_type=all_gather`).
- `p2p`: ring attention (Liu et al. 2023; Transformer Engine's `p2p` CP): K/V shards rotate
  around the ring with `batch_isend_irecv` while the current block is computed; partial results
  are merged with their log-sum-exp. A custom backward rotates K/V again together with their
  accumulating gradients, which reach their owners after one more hop (the flash-attention
  backward, Dao 2022: dS = P * (dP - rowsum(dO * O))).

Every rank holds the same local document lengths (2 chunks of each document), so all shards share
one padded layout `[N, H, S, D]`; masks come from each token's position in its document:
key j is visible to query i iff it is real (not padding) and pos_k(j) <= pos_q(i).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hcp.config.layouts import CP_COMMS
from hcp.model.attention import doc_slots, padded_attention, to_padded
from hcp.model.collectives import gather_seq, group_rank, group_size
from hcp.parallel.cp_sharding import cp_shard


@dataclass
class CPAttentionPlan:
    """Per micro-batch metadata shared by all layers. N documents, S longest local document."""

    group: object
    comm: str
    doc: torch.Tensor
    """long [T_loc]: document of each local slot."""
    slot: torch.Tensor
    """long [T_loc]: offset of each local slot within its local document."""
    query_pos: torch.Tensor
    """long [N, S]: this rank's positions; layout padding gets a position past every key."""
    key_pos: torch.Tensor
    """long [c, N, S]: positions of every CP rank's slots."""
    key_real: torch.Tensor
    """bool [c, N, S]: False at CP padding and at layout padding."""

    def mask(self, ranks: slice | int) -> torch.Tensor:
        """bool [N, S, S] (one rank) or [N, S, c * S] (all ranks, in rank order)."""
        pos, real = self.key_pos[ranks], self.key_real[ranks]
        if pos.dim() == 3:
            pos, real = (t.permute(1, 0, 2).flatten(1) for t in (pos, real))
        return real[:, None, :] & (pos[:, None, :] <= self.query_pos[:, :, None])


def build_cp_plan(cu_seqlens: torch.Tensor, group, comm: str = "allgather") -> CPAttentionPlan:
    """Plan for this rank of `group` from the whole micro-batch's cu_seqlens (int32 [N + 1]).

    Raises ValueError for an unknown `comm`.
    """
    if comm not in CP_COMMS:
        raise ValueError(f"cp_comm={comm!r} is unknown: use one of {CP_COMMS}")
    size, rank = group_size(group), group_rank(group)
    shards = [cp_shard(cu_seqlens, size, r) for r in range(size)]
    local_cu = shards[0].cu_seqlens
    doc, slot = doc_slots(local_cu)
    n, s = len(local_cu) - 1, shards[0].max_seqlen

    def padded(values: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((n, s), fill, dtype=values.dtype, device=values.device)
        return out.index_put((doc, slot), values)

    key_pos = torch.stack([padded(sh.position_ids, 0) for sh in shards])
    key_real = torch.stack([padded(sh.valid, False) for sh in shards])
    query_pos = padded(shards[rank].position_ids, torch.iinfo(torch.long).max)
    return CPAttentionPlan(group, comm, doc, slot, query_pos, key_pos, key_real)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 plan: CPAttentionPlan) -> torch.Tensor:
    """Local queries q [T_loc, Hq, D] attend to the keys/values k, v [T_loc, Hkv, D] of every
    CP rank. Returns [T_loc, Hq, D]."""
    n, s = plan.query_pos.shape
    qp = to_padded(q, plan.doc, plan.slot, n, s)                          # [N, Hq, S, D]
    if plan.comm == "allgather":
        c = group_size(plan.group)
        kv = gather_seq(torch.stack([k, v], dim=1), plan.group)           # [c * T_loc, 2, Hkv, D]
        kv = kv.view(c, -1, *kv.shape[1:])
        ranks = torch.arange(c, device=q.device)[:, None]
        kv_pad = kv.new_zeros(c, n, s, *kv.shape[2:]).index_put(
            (ranks, plan.doc[None], plan.slot[None]), kv)                  # [c, N, S, 2, Hkv, D]
        kv_pad = kv_pad.permute(3, 1, 4, 0, 2, 5).flatten(3, 4)          # [2, N, Hkv, c*S, D]
        out = padded_attention(qp, kv_pad[0], kv_pad[1], plan.mask(slice(None))[:, None])
    else:
        kp, vp = (to_padded(t, plan.doc, plan.slot, n, s) for t in (k, v))
        out = _RingAttention.apply(qp, kp, vp, plan)
    return out.transpose(1, 2)[plan.doc, plan.slot]


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


def _block_scores(q5, k, mask, scale):
    """q5 [N, Hkv, g, Sq, D], k [N, Hkv, Sk, D], mask [N, Sq, Sk] -> masked scores."""
    scores = torch.einsum("nhgqd,nhkd->nhgqk", q5, k) * scale
    return scores.masked_fill(~mask[:, None, None], float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp with -inf (rows that see no key) replaced by 0, so exp(-inf - 0) = 0."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


class _RingAttention(torch.autograd.Function):
    """Ring attention on padded shards: q [N, Hq, S, D], k, v [N, Hkv, S, D] -> [N, Hq, S, D]."""

    @staticmethod
    def forward(ctx, qp, kp, vp, plan):
        group = plan.group
        size, rank = group_size(group), group_rank(group)
        n, hkv, s, d = kp.shape
        scale = 1.0 / math.sqrt(d)
        q5 = qp.view(n, hkv, -1, s, d)
        out = torch.zeros_like(q5)
        lse = torch.full(q5.shape[:-1], float("-inf"), dtype=q5.dtype, device=q5.device)
        kv = torch.stack([kp, vp])
        for step in range(size):
            if step < size - 1:
                nxt_kv, reqs = _ring_shift(kv, group, tag=0)
            scores = _block_scores(q5, kv[0], plan.mask((rank - step) % size), scale)
            blk_lse = torch.logsumexp(scores, dim=-1)
            blk_out = torch.einsum("nhgqk,nhkd->nhgqd", torch.exp(scores - _finite(blk_lse)[..., None]), kv[1])
            new_lse = _finite(torch.logaddexp(lse, blk_lse))
            out = (out * torch.exp(lse - new_lse)[..., None]
                   + blk_out * torch.exp(blk_lse - new_lse)[..., None])
            lse = torch.logaddexp(lse, blk_lse)
            if step < size - 1:
                _wait(reqs)
                kv = nxt_kv
        ctx.plan, ctx.scale = plan, scale
        ctx.save_for_backward(q5, kp, vp, out, lse)
        return out.view_as(qp)

    @staticmethod
    def backward(ctx, grad_out):
        q5, kp, vp, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        group = plan.group
        size, rank = group_size(group), group_rank(group)
        dout = grad_out.reshape(out.shape)
        delta = (dout * out).sum(-1, keepdim=True)                        # [N, Hkv, g, S, 1]
        lse = _finite(lse)[..., None]
        dq = torch.zeros_like(q5)
        kv = torch.stack([kp, vp])
        for step in range(size):
            if step < size - 1:
                nxt_kv, kv_reqs = _ring_shift(kv, group, tag=0)
            probs = torch.exp(_block_scores(q5, kv[0], plan.mask((rank - step) % size), scale) - lse)
            dscores = probs * (torch.einsum("nhgqd,nhkd->nhgqk", dout, kv[1]) - delta)
            dq += torch.einsum("nhgqk,nhkd->nhgqd", dscores, kv[0]) * scale
            dkv = torch.stack([torch.einsum("nhgqk,nhgqd->nhkd", dscores, q5) * scale,
                               torch.einsum("nhgqk,nhgqd->nhkd", probs, dout)])
            if step > 0:
                _wait(dkv_reqs)
                dkv = dkv + recv_dkv
            # the gradient travels with its K/V; one hop after the last step it is home
            recv_dkv, dkv_reqs = _ring_shift(dkv, group, tag=1)
            if step < size - 1:
                _wait(kv_reqs)
                kv = nxt_kv
        _wait(dkv_reqs)
        return dq.view_as(grad_out), recv_dkv[0], recv_dkv[1], None
