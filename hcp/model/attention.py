"""Causal attention over packed documents (THD) without context parallelism: the `torch` backend.

Layout: `q [T, Hq, D]`, `k, v [T, Hkv, D]` with `Hq` a multiple of `Hkv` (grouped-query
attention), `cu_seqlens` int32 `[N + 1]` (prefix sums of the N document lengths) and
`max_seqlen` (the longest document). Each token attends causally to earlier tokens of its own
document only.

On CUDA in fp16/bf16 the whole micro-batch is ONE call of aten's varlen flash-attention 2 kernel
(`_VarlenFlash`: ragged documents by `cu_seqlens`, causal, grouped-query heads as they are),
whatever the number of documents. Elsewhere (CPU, and fp32 on CUDA, which the
flash kernel does not take) each document is one `F.scaled_dot_product_attention(is_causal=True)`
call on views of q, k, v (no padding, no mask tensor, no index bookkeeping). On CPU (4-d inputs)
torch dispatches it to its fused flash kernel, which is block-wise with fp32 softmax statistics
(Dao et al. 2022), so a long document costs O(T) memory; on CUDA to the memory-efficient kernel
(kv heads expanded for grouped-query attention there, so no kernel falls back to the O(L^2) math
path). Under CP the same math runs block-wise across ranks in `hcp.model.cp_attention`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

VARLEN_DTYPES = (torch.float16, torch.bfloat16)
"""Dtypes of aten's CUDA flash-attention kernels (`_VarlenFlash`)."""


class _VarlenFlash(torch.autograd.Function):
    """Causal attention over ragged documents in one kernel call: q [T, Hq, D], k, v [T, Hkv, D]
    (CUDA, fp16/bf16), `cu_seqlens` int32 [N + 1] on the device, `max_seqlen` (host int) ->
    [T, Hq, D]. aten's flash-attention 2 varlen forward and backward (Dao 2023), what
    `torch.nn.attention.varlen.varlen_attn` runs; called as aten ops, which FakeTensorMode also
    runs on a CPU-only build (the custom op around them aborts there in a device guard)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen):
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, seed, offset)
        ctx.max_seqlen = max_seqlen
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        n = ctx.max_seqlen
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu, cu, n, n, 0.0, True, seed, offset)
        return dq, dk, dv, None, None


def check_thd(q: torch.Tensor, k: torch.Tensor, lengths) -> None:
    """Raise ValueError unless Hq is a multiple of Hkv and q, k hold sum(lengths) tokens."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads "
                         f"({k.shape[1]})")
    if not q.shape[0] == k.shape[0] == sum(lengths):
        raise ValueError(f"q has {q.shape[0]} tokens, k {k.shape[0]}, the documents (cu_seqlens) "
                         f"{sum(lengths)}: they must be equal")


def host_seqlens(cu_seqlens: torch.Tensor, seqlens=None) -> tuple:
    """The document lengths on the host: `seqlens` when known (the step plan's), else read
    from `cu_seqlens` (one device-to-host read: call it once per micro-batch, not per layer)."""
    return (tuple(seqlens)
            if seqlens is not None else tuple((cu_seqlens[1:] - cu_seqlens[:-1]).tolist()))


def thd_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cu_seqlens: torch.Tensor, max_seqlen: int, seqlens=None) -> torch.Tensor:
    """Causal attention within each document. Shapes in the module docstring; returns
    [T, Hq, D]. `max_seqlen` bounds the document lengths (flash/te size their kernels by it).
    `seqlens`: the N document lengths on the host (`host_seqlens`; None reads cu_seqlens,
    except on the CUDA varlen path, which checks only the heads then).

    Raises:
        ValueError: Hq is not a multiple of Hkv, the token counts disagree with cu_seqlens, or a
            document is longer than max_seqlen.
    """
    varlen = q.device.type == "cuda" and q.dtype in VARLEN_DTYPES
    if varlen and seqlens is None:  # the kernel reads cu_seqlens on the device: no host read here
        check_thd(q, k, (q.shape[0],))
    else:
        lengths = host_seqlens(cu_seqlens, seqlens)
        check_thd(q, k, lengths)
        if lengths and max(lengths) > max_seqlen:
            raise ValueError(f"a document has {max(lengths)} tokens, more than "
                             f"max_seqlen={max_seqlen}")
    if varlen:
        return _VarlenFlash.apply(q, k, v, cu_seqlens, max_seqlen)
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.device.type != "cpu":
        # not every CUDA SDPA kernel takes enable_gqa; one that does not would fall back to the
        # math kernel, which materializes [H, L, L] scores: expand the kv heads instead
        rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), False
    heads_first = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731 - [L, H, D] -> [1, H, L, D]
    outs = [F.scaled_dot_product_attention(heads_first(qd), heads_first(kd), heads_first(vd),
                                           is_causal=True, enable_gqa=gqa)[0].transpose(0, 1)
            for qd, kd, vd in zip(q.split(lengths), k.split(lengths), v.split(lengths))
            if len(qd)]
    return torch.cat(outs) if outs else q.new_zeros(q.shape)
