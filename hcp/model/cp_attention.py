"""Causal THD attention across context-parallel ranks (head-tail shards of
`hcp.parallel.cp_sharding`) on fused kernels (`hcp.model.cp_kernels`), exact in values and
gradients. Two strategies (`cp_comm`): `allgather` (default; Llama 3 / Megatron-LM
`cp_comm_type=all_gather`): all-gather K/V once, reduce-scatter their gradients back; `p2p`:
ring attention (Liu et al. 2023; Transformer Engine's `p2p`): K/V shards rotate with
`batch_isend_irecv`, partial outputs merged by log-sum-exp in fp32.

CP size c cuts a document of L tokens into 2c chunks of k = ceil(L / 2c) positions, chunk i
owned by rank min(i, 2c-1-i), stored as [head chunk, tail chunk]. Per document rank r computes
its own 2k rows causally, then allgather: both chunks against chunks 0..r-1 (the heads of
ranks 0..r-1) in one call, and its tail against chunks r+1..2c-2-r (the whole shards of ranks
r+1..c-1); p2p, source s: s < r both against s's head, s > r its tail against both.
Documents of one chunk size share each `Call`; on a ragged kernel (CUDA's varlen flash) the
documents of every chunk size share it (`Segments`): a few calls per micro-batch
and layer whatever the lengths. Under allgather a short document (k <= `SHORT_CHUNK`) on a
masking kernel is one masked call. The plan comes from the host
lengths (`host_cu_seqlens`: no device-to-host read); the CP group is per micro-batch."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from hcp.comm.trace import traced
from hcp.config.layouts import CP_COMMS
from hcp.model.collectives import all_gather_rows, group_rank, group_size, reduce_scatter_rows
from hcp.model.cp_kernels import Kernel, acc_dtype, fused_kernel
from hcp.parallel.cp_sharding import head_tail_chunks, host_cu
from hcp.parallel.upload import upload

SHORT_CHUNK = 32
"""Chunk size up to which an allgather document is one masked call (kernels with masks)."""


@dataclass
class Rows:
    """Rows of a `[T, ...]` tensor taken as `[n, L, ...]` blocks: a contiguous range (a view, no
    copy) when `index` is None, else the rows `index` (long [n, L], on the tensors' device)."""

    start: int
    n: int
    length: int
    index: torch.Tensor | None = None

    @classmethod
    def of(cls, rows: np.ndarray, device) -> "Rows":
        """rows: int [n, L] on the host."""
        n, length = rows.shape
        if n * length and np.array_equal(rows.ravel(), rows.flat[0] + np.arange(n * length)):
            return cls(int(rows.flat[0]), n, length)
        return cls(0, n, length, upload(rows, device, torch.long))

    def take(self, x: torch.Tensor) -> torch.Tensor:
        if self.index is None:
            return x[self.start:self.start + self.n * self.length].view(self.n, self.length,
                                                                        *x.shape[1:])
        return x.index_select(0, self.index.view(-1)).view(self.n, self.length, *x.shape[1:])

    def put(self, x: torch.Tensor, value: torch.Tensor) -> None:
        if self.index is None:
            self.take(x).copy_(value)
        else:
            x.index_copy_(0, self.index.view(-1), value.flatten(0, 1))

    def add(self, x: torch.Tensor, value: torch.Tensor) -> None:
        if self.index is None:
            self.take(x).add_(value)
        else:
            x.index_add_(0, self.index.view(-1), value.flatten(0, 1))


@dataclass
class Segments:
    """Rows of a `[T, ...]` tensor taken as m ragged blocks, flat: `index` long [R] (on the
    tensors' device), block bounds `cu` int32 [m + 1] (device) and `sizes` (host ints [m]),
    `max_len` the longest block. What a ragged kernel (`Kernel.ragged`) takes."""

    index: torch.Tensor
    cu: torch.Tensor
    sizes: list
    max_len: int

    @classmethod
    def of(cls, blocks: list, device) -> "Segments":
        """blocks: int [n_j, L_j] row arrays on the host (n_j blocks of L_j rows each)."""
        sizes = [b.shape[1] for b in blocks for _ in range(b.shape[0])]
        index = np.concatenate([b.ravel() for b in blocks])
        return cls(upload(index, device, torch.long),
                   upload(np.concatenate([[0], np.cumsum(sizes)]), device, torch.int32),
                   sizes, max(sizes))

    def take(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, self.index)

    def put(self, x: torch.Tensor, value: torch.Tensor) -> None:
        x.index_copy_(0, self.index, value)

    def add(self, x: torch.Tensor, value: torch.Tensor) -> None:
        x.index_add_(0, self.index, value)


@dataclass
class Call:
    """One fused kernel call: n blocks of `q` rows (local queries) against `k` rows (of the
    key source), fully or top-left causal; `Segments` on a ragged kernel."""

    q: Rows | Segments
    k: Rows | Segments
    causal: bool
    first: bool
    """The first call of its query rows: its result and dq are written, not merged or added
    (a plan's first calls cover every local row once, before any other call of that row)."""
    mask: torch.Tensor | None = None
    """bool [Lq, Lk] shared by the n blocks (True = attend), or None."""


@dataclass
class CPAttentionPlan:
    """Per micro-batch calls shared by all layers of one rank."""

    group: object
    comm: str
    calls: list[list[Call]]
    """allgather: one list, k rows index the gathered K/V (rank-major, each rank's local rows);
    p2p: calls[s] index the K/V shard of rank s (its local rows)."""
    kernel: Kernel


def _chunk_rows(i: int, c: int, k: int, t_loc: int, allgather: bool) -> np.ndarray:
    """Offsets (from a document's local start) of chunk i's k rows: in the gathered K/V
    (rank-major) under allgather, else in its owner's shard."""
    owner = min(i, 2 * c - 1 - i)
    return (owner * t_loc if allgather else 0) + (0 if i < c else k) + np.arange(k)


def _doc_calls(c: int, r: int, k: int, t_loc: int, comm: str, masked: bool) -> dict:
    """{source: [(q offsets [Lq], k offsets [Lk], causal, mask or None, first)]} of one
    document of chunk size k (`masked`: the kernel takes masks)."""
    head, tail = np.arange(k), k + np.arange(k)
    local = np.arange(2 * k)
    if comm == "allgather":
        def rows(chunks):
            return np.concatenate([_chunk_rows(i, c, k, t_loc, True) for i in chunks])
        if masked and k <= SHORT_CHUNK:
            q_pos = np.concatenate([r * k + head, (2 * c - 1 - r) * k + head])
            mask = np.arange((2 * c - r) * k)[None, :] <= q_pos[:, None]
            return {0: [(local, rows(range(2 * c - r)), False, mask, True)]}
        calls = [(local, r * t_loc + local, True, None, True)]
        if r:                                          # head and tail both see chunks 0..r-1
            calls.append((local, rows(range(r)), False, None, False))
        if r < c - 1:                  # the tail also sees chunks r+1..2c-2-r: ranks r+1..c-1
            calls.append((tail, np.concatenate([j * t_loc + local for j in range(r + 1, c)]),
                          False, None, False))
        return {0: calls}
    return {s: [(local, local, True, None, True)] if s == r else [(local, head, False, None, False)]
            if s < r else [(tail, local, False, None, False)] for s in range(c)}


def cp_calls(lengths, cp_size: int, cp_rank: int, comm: str = "allgather",
             device="cpu", masked: bool = True, ragged: bool = False) -> list[list[Call]]:
    """The calls of CP rank `cp_rank` of `cp_size` (see `CPAttentionPlan.calls`) for the whole
    micro-batch's document `lengths` (host ints [N]); row indices and masks on `device`;
    `masked`: the kernel takes masks (short documents as one call); `ragged`: the kernel takes
    ragged blocks (one call per role for every chunk size, `Segments`). Pure function.

    Raises ValueError for an unknown `comm`.
    """
    if comm not in CP_COMMS:
        raise ValueError(f"cp_comm={comm!r} is unknown: use one of {CP_COMMS}")
    c, r = cp_size, cp_rank
    chunk = head_tail_chunks(lengths, c)
    starts = np.cumsum(2 * chunk) - 2 * chunk
    t_loc = int(2 * chunk.sum())
    sources = range(c) if comm == "p2p" else range(1)
    grouped: dict = {s: defaultdict(list) for s in sources}       # (shape key) -> q, k rows
    for k in np.unique(chunk[chunk > 0]).tolist():
        doc_start = starts[chunk == k]                             # [n] documents of chunk k
        for s, calls in _doc_calls(c, r, k, t_loc, comm, masked).items():
            for i, (q_off, k_off, *shape) in enumerate(calls):
                grouped[s][i if ragged else (k, i)].append(
                    (doc_start[:, None] + q_off, doc_start[:, None] + k_off, *shape))
    if ragged:
        return [[Call(Segments.of([p[0] for p in parts], device),
                      Segments.of([p[1] for p in parts], device), parts[0][2], parts[0][4])
                 for parts in grouped[s].values()] for s in sources]
    return [[Call(Rows.of(np.concatenate([p[0] for p in parts]), device),
                  Rows.of(np.concatenate([p[1] for p in parts]), device), parts[0][2], parts[0][4],
                  None if parts[0][3] is None else upload(parts[0][3], device))
             for parts in grouped[s].values()] for s in sources]


def scored_pairs(lengths, cp_size: int, cp_rank: int, comm: str = "allgather",
                 masked: bool = True) -> float:
    """Query-key pairs CP rank `cp_rank` of `cp_size` scores for documents of `lengths` (host
    ints [N]): the blocks of its `cp_calls` (a causal block counts half: its kernel skips the
    masked half; a masked call counts in full: its kernel scores every pair), summed over key
    sources. At cp_size 1: `sum L^2 / 2` (`hcp.model.attention`). FLOPs: 4 * Hq * D per pair
    forward. Raises ValueError as `cp_calls`."""
    lens = np.asarray(lengths, dtype=np.int64)
    if cp_size == 1:
        return float((lens.astype(np.float64) ** 2).sum() / 2)
    if comm not in CP_COMMS:
        raise ValueError(f"cp_comm={comm!r} is unknown: use one of {CP_COMMS}")
    chunk = head_tail_chunks(lens, cp_size)
    pairs = 0.0
    for k in np.unique(chunk[chunk > 0]).tolist():
        blocks = sum(len(q) * len(kv) * (0.5 if causal else 1.0) for calls in
                     _doc_calls(cp_size, cp_rank, k, 0, comm, masked).values()
                     for q, kv, causal, *_ in calls)
        pairs += blocks * int((chunk == k).sum())
    return pairs


def build_cp_plan(cu_seqlens, group, comm: str = "allgather", device="cpu") -> CPAttentionPlan:
    """Plan for this rank of `group` (the micro-batch's CP group; None = size 1) from the whole
    micro-batch's host cu_seqlens (int [N + 1]: `hcp.parallel.cp_sharding.host_cu`); indices
    and kernel for `device`. Raises ValueError as `cp_calls`, `host_cu` and `fused_kernel`."""
    kernel = fused_kernel(device)
    calls = cp_calls(np.diff(host_cu(cu_seqlens)), group_size(group), group_rank(group), comm,
                     device, kernel.masks, kernel.ragged)
    return CPAttentionPlan(group, comm, calls, kernel)


def cp_attention_for(backend: str, comm: str) -> Callable | None:
    """CP attention of a resolved attention backend, chosen once when the model is built:
    `for_micro_batch(cu_seqlens_host, group, device) -> attend(q, k, v)` (the plan of one
    micro-batch, shared by its layers); `torch`: hcp's calls on the device's fused kernels, `te`:
    Transformer Engine's THD CP (`hcp.model.te_cp`, imported here, lazily). None: the backend
    has no CP path (`flash`). Raises ImportError for `te` when Transformer Engine is missing."""
    if backend == "te":
        from hcp.model.te_cp import te_cp_attention
        return te_cp_attention(comm)
    if backend != "torch":
        return None

    def for_micro_batch(cu_seqlens_host, group, device):
        plan = build_cp_plan(cu_seqlens_host, group, comm, device)
        return lambda q, k, v: cp_attention(q, k, v, plan)
    return for_micro_batch


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 plan: CPAttentionPlan) -> torch.Tensor:
    """Local queries q [T_loc, Hq, D] attend to the keys/values k, v [T_loc, Hkv, D] of every
    CP rank of `plan.group`. Returns [T_loc, Hq, D] in q's dtype."""
    if plan.comm == "allgather":
        return _FusedAttention.apply(q, torch.stack([k, v], dim=1), plan)
    return _RingAttention.apply(q, k, v, plan)


@dataclass
class Partial:
    """Merged attention of the calls folded so far, per query row: out [T, Hq, D] and lse
    [T, Hq] in `acc_dtype` (uninitialised until a row's first call writes it)."""

    out: torch.Tensor
    lse: torch.Tensor

    @classmethod
    def empty(cls, q: torch.Tensor) -> "Partial":
        acc = acc_dtype(q.dtype)
        return cls(torch.empty(q.shape, dtype=acc, device=q.device),
                   torch.empty(q.shape[:2], dtype=acc, device=q.device))

    def fold(self, q, kv, calls: list[Call], kernel: Kernel) -> None:
        """Merge the calls' attention of q over kv `[T_k, 2, Hkv, D]` (K and V stacked: one
        row gather per call) in place, fp32; a first call writes its rows."""
        with torch.autocast(q.device.type, enabled=False):
            for call in calls:
                kv_rows = call.k.take(kv)
                shape = (call.q, call.k) if kernel.ragged else (call.mask,)
                out, lse = kernel.forward(call.q.take(q), kv_rows.select(-3, 0),
                                          kv_rows.select(-3, 1), call.causal, *shape)
                if call.first:
                    call.q.put(self.out, out.to(self.out.dtype))
                    call.q.put(self.lse, lse.to(self.lse.dtype))
                    continue
                old_out, old_lse = call.q.take(self.out), call.q.take(self.lse)
                new = torch.logaddexp(old_lse, lse)
                merged = old_out.mul_(torch.exp_(old_lse.sub_(new))[..., None])
                merged.addcmul_(out, torch.exp_(lse.sub_(new))[..., None])
                if call.q.index is not None:                        # views need no write-back
                    call.q.put(self.out, merged)
                    call.q.put(self.lse, new)
                else:
                    old_lse.copy_(new)

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        return self.out.to(dtype)


def grads(q, kv, dout, out, lse, calls: list[Call], kernel: Kernel, dq, dkv) -> None:
    """Add the calls' gradients to the fp32 accumulators dq [Tq, Hq, D] (a first call writes
    its rows) and dkv [Tk, 2, Hkv, D] (of kv, K and V stacked); out, lse: the merged attention
    of every call of the query rows (`Partial`)."""
    with torch.autocast(q.device.type, enabled=False):
        for call in calls:
            rows = call.q.take
            kv_rows = call.k.take(kv)
            shape = (call.q, call.k) if kernel.ragged else (call.mask,)
            dq_c, dk_c, dv_c = kernel.backward(rows(dout), rows(q), kv_rows.select(-3, 0),
                                               kv_rows.select(-3, 1), rows(out), rows(lse),
                                               call.causal, *shape)
            (call.q.put if call.first else call.q.add)(dq, dq_c.to(dq.dtype))
            if call.k.index is None:                                # views: added in place
                call.k.add(dkv[:, 0], dk_c.to(dkv.dtype))
                call.k.add(dkv[:, 1], dv_c.to(dkv.dtype))
            else:  # one index_add into contiguous rows: into the strided halves it is ~3x slower
                call.k.add(dkv, torch.stack([dk_c, dv_c], dim=-3).to(dkv.dtype))


class _FusedAttention(torch.autograd.Function):
    """q [T_loc, Hq, D] against the K/V of every rank of `plan.group` through `plan.calls[0]`:
    kv [T_loc, 2, Hkv, D] (K and V stacked) is all-gathered here and its gradient, summed in
    one fp32 buffer, reduce-scattered in that buffer (no copy for the collective)."""

    @staticmethod
    @traced("hcp.cp_attention_forward allgather")
    def forward(ctx, q, kv, plan):
        kv = all_gather_rows(kv, plan.group)                               # [c * T_loc, 2, Hkv, D]
        state = Partial.empty(q)
        state.fold(q, kv, plan.calls[0], plan.kernel)
        out = state.result(q.dtype)
        ctx.plan = plan
        ctx.save_for_backward(q, kv, out, state.lse)
        return out

    @staticmethod
    @traced("hcp.cp_attention_backward allgather")
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        dq = torch.empty(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc_dtype(kv.dtype), device=kv.device)
        grads(q, kv, dout, out, lse, ctx.plan.calls[0], ctx.plan.kernel, dq, dkv)
        return dq.to(q.dtype), reduce_scatter_rows(dkv, ctx.plan.group).to(kv.dtype), None


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
    @traced("hcp.cp_attention_forward p2p")
    def forward(ctx, q, k, v, plan):
        group = plan.group
        size, rank = group_size(group), group_rank(group)
        state = Partial.empty(q)
        kv = torch.stack([k, v], dim=1)                                   # [T_loc, 2, Hkv, D]
        for step in range(size):
            if step < size - 1:
                nxt_kv, reqs = _ring_shift(kv, group, tag=0)
            state.fold(q, kv, plan.calls[(rank - step) % size], plan.kernel)
            if step < size - 1:
                _wait(reqs)
                kv = nxt_kv
        out = state.result(q.dtype)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, state.lse)
        return out

    @staticmethod
    @traced("hcp.cp_attention_backward p2p")
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        group = plan.group
        size, rank = group_size(group), group_rank(group)
        acc = acc_dtype(q.dtype)
        dq = torch.empty(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v], dim=1)
        for step in range(size):
            if step < size - 1:
                nxt_kv, kv_reqs = _ring_shift(kv, group, tag=0)
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            grads(q, kv, dout, out, lse, plan.calls[(rank - step) % size], plan.kernel, dq, dkv)
            if step > 0:
                _wait(dkv_reqs)
                dkv += recv_dkv
            # the fp32 gradient travels with its K/V; one hop after the last step it is home
            recv_dkv, dkv_reqs = _ring_shift(dkv, group, tag=1)
            if step < size - 1:
                _wait(kv_reqs)
                kv = nxt_kv
        _wait(dkv_reqs)
        return dq.to(q.dtype), recv_dkv[:, 0].to(k.dtype), recv_dkv[:, 1].to(v.dtype), None
