"""Fused attention kernels of CP attention (`hcp.model.cp_attention`).

A call attends n blocks of one shape: q `[n, Lq, Hq, D]` to k, v `[n, Lk, Hkv, D]` (grouped-query),
fully, top-left causal (`causal`, Lq == Lk) or through a shared bool `mask [Lq, Lk]` (kernels
with `masks`). The forward returns out `[n, Lq, Hq, D]` (q's dtype) and lse `[n, Lq, Hq]` (fp32),
so partial results over disjoint keys merge exactly; the backward takes the MERGED out and lse
(the flash backward, Dao 2023), so each call's gradients are its exact share. Kernels: `cpu`
(aten's CPU flash attention), `cuda` (aten's flash-attn 2 varlen kernels, fp16/bf16; fp32 runs
`math`), `math` (plain torch with materialized scores: the tests' reference).

A `ragged` kernel (`cuda`) takes one call over blocks of DIFFERENT lengths: q `[R, Hq, D]` rows
and k, v `[S, Hkv, D]` rows cut into m blocks by `Segments` (device bounds `cu [m + 1]`, the
host `sizes`), out `[R, Hq, D]`, lse `[R, Hq]`: the varlen kernel's own layout, so the documents
of every chunk size go in one call. Its fp32 fallback runs `math` block by block."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import math

import torch


@dataclass(frozen=True)
class Kernel:
    """A device's pair of fused attention ops (shapes in the module docstring)."""

    name: str
    forward: Callable
    """(q, k, v, causal, mask) -> (out, lse fp32)."""
    backward: Callable
    """(dout, q, k, v, out, lse, causal, mask) -> (dq, dk, dv) in the inputs' dtype."""
    masks: bool
    """Whether it takes a `mask` (else only None)."""
    ragged: bool = False
    """Whether forward/backward take ragged blocks: (q, k, v, causal, q_segments, k_segments)
    and (dout, q, k, v, out, lse, causal, q_segments, k_segments), rows flat (module docstring)."""


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)                                        # [n, L, H, D] -> [n, H, L, D]


def _additive(mask, dtype):
    """bool [Lq, Lk] -> [1, 1, Lq, Lk] of 0 / -inf in `dtype` (the CPU kernel's mask), or None."""
    if mask is None:
        return None
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill_(~mask, float("-inf"))[None, None]


CPU_LONG_QUERY = 768
"""Query length from which torch's CPU flash kernel uses 256-row query blocks (64 below): K/V
blocks are then reused by 4x more queries."""


def _folds(q, k, causal) -> bool:
    """Fold grouped-query heads into the query rows (`_fold`): exact for a full or masked call
    (no causal positions), done when it lifts a short call to the kernel's long query blocks."""
    rep = q.shape[2] // k.shape[2]
    return not causal and rep > 1 and q.shape[1] < CPU_LONG_QUERY <= rep * q.shape[1]


def _fold(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[n, L, Hq, ...] -> [n, Hkv, rep * L, ...]: the rep query heads sharing a kv head (SDPA's
    grouped-query order: head h reads kv head h // rep) as one longer query sequence."""
    n, length, hq = x.shape[:3]
    x = x.reshape(n, length, hkv, hq // hkv, *x.shape[3:]).movedim(1, 3)
    return x.reshape(n, hkv, -1, *x.shape[4:])


def _unfold(x: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of `_fold`: [n, Hkv, rep * L, ...] -> [n, L, Hq, ...]."""
    n, hkv = x.shape[:2]
    x = x.reshape(n, hkv, -1, length, *x.shape[3:]).movedim(3, 1)
    return x.reshape(n, length, -1, *x.shape[4:])


def _cpu_forward(q, k, v, causal, mask=None):
    if _folds(q, k, causal):
        rep, length = q.shape[2] // k.shape[2], q.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _fold(q, k.shape[2]), _heads_first(k), _heads_first(v), 0.0, False,
            attn_mask=_additive(None if mask is None else mask.repeat(rep, 1), q.dtype))
        return _unfold(out, length), _unfold(lse, length)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _heads_first(q), _heads_first(k), _heads_first(v), 0.0, causal,
        attn_mask=_additive(mask, q.dtype))
    return _heads_first(out), lse.transpose(1, 2)


def _cpu_backward(dout, q, k, v, out, lse, causal, mask=None):
    if _folds(q, k, causal):
        rep, length, hkv = q.shape[2] // k.shape[2], q.shape[1], k.shape[2]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _fold(dout, hkv), _fold(q, hkv), _heads_first(k), _heads_first(v), _fold(out, hkv),
            _fold(lse, hkv), 0.0, False,
            attn_mask=_additive(None if mask is None else mask.repeat(rep, 1), q.dtype))
        return _unfold(dq, length), _heads_first(dk), _heads_first(dv)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _heads_first(dout), _heads_first(q), _heads_first(k), _heads_first(v), _heads_first(out),
        lse.transpose(1, 2), 0.0, causal, attn_mask=_additive(mask, q.dtype))
    return tuple(_heads_first(g) for g in grads)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of statistics and accumulators: fp32, or fp64 for fp64 inputs (tests)."""
    return torch.promote_types(dtype, torch.float32)


def _math_scores(q, k, causal, mask):
    """Scaled scores [n, Hq, Lq, Lk] in fp32 (or wider), -inf above the causal diagonal and
    where `mask` is False."""
    rep = q.shape[2] // k.shape[2]
    qf = _heads_first(q.to(acc_dtype(q.dtype)))
    kf = _heads_first(k.to(qf.dtype).repeat_interleave(rep, 2))
    s = torch.matmul(qf, kf.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(),
                          float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s, qf, kf


def _math_forward(q, k, v, causal, mask=None):
    s, _, _ = _math_scores(q, k, causal, mask)
    lse = torch.logsumexp(s, -1)                                    # [n, Hq, Lq]
    vf = _heads_first(v.to(s.dtype).repeat_interleave(q.shape[2] // k.shape[2], 2))
    out = torch.matmul(torch.exp(s - lse[..., None]), vf)
    return _heads_first(out).to(q.dtype), lse.transpose(1, 2)


def _math_backward(dout, q, k, v, out, lse, causal, mask=None):
    s, qf, kf = _math_scores(q, k, causal, mask)
    rep = q.shape[2] // k.shape[2]
    p = torch.exp(s - lse.transpose(1, 2).to(s.dtype)[..., None])   # [n, Hq, Lq, Lk]
    do = _heads_first(dout.to(s.dtype))
    vf = _heads_first(v.to(s.dtype).repeat_interleave(rep, 2))
    delta = (do * _heads_first(out.to(s.dtype))).sum(-1, keepdim=True)
    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta) / math.sqrt(q.shape[-1])
    dq = torch.matmul(ds, kf)
    dk, dv = torch.matmul(ds.transpose(-1, -2), qf), torch.matmul(p.transpose(-1, -2), do)
    fold = lambda g: _heads_first(g).unflatten(2, (-1, rep)).sum(3)  # noqa: E731 - GQA groups
    return _heads_first(dq).to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


def _cuda_ragged_forward(q, k, v, causal, qs, ks):
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, qs.cu, ks.cu, qs.max_len, ks.max_len, 0.0, causal, False)
    return out, lse.t()                                             # lse [Hq, R] -> [R, Hq]


def _cuda_ragged_backward(dout, q, k, v, out, lse, causal, qs, ks):
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)       # no dropout
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse.t().contiguous(), qs.cu, ks.cu, qs.max_len, ks.max_len, 0.0,
        causal, rng, torch.empty(0, device=q.device))


def _blocks(x, segments):
    """Flat rows [R, ...] -> one [1, L_i, ...] block per segment (host sizes: no device read)."""
    return [b[None] for b in x.split(segments.sizes)]


def _ragged_math_forward(q, k, v, causal, qs, ks):
    parts = [_math_forward(*blocks, causal) for blocks in
             zip(_blocks(q, qs), _blocks(k, ks), _blocks(v, ks))]
    return torch.cat([o[0] for o, _ in parts]), torch.cat([lse[0] for _, lse in parts])


def _ragged_math_backward(dout, q, k, v, out, lse, causal, qs, ks):
    parts = [_math_backward(*blocks, causal) for blocks in
             zip(_blocks(dout, qs), _blocks(q, qs), _blocks(k, ks), _blocks(v, ks),
                 _blocks(out, qs), _blocks(lse, qs))]
    return tuple(torch.cat([g[0] for g in grads]) for grads in zip(*parts))


def _cuda_or_math(flash, fallback):
    def run(q, *args):
        half = q.dtype in (torch.float16, torch.bfloat16)
        return (flash if half else fallback)(q, *args)
    return run


MATH = Kernel("math", _math_forward, _math_backward, masks=True)
RAGGED_MATH = Kernel("ragged_math", _ragged_math_forward, _ragged_math_backward, masks=False,
                     ragged=True)
"""`math` over ragged blocks, one block at a time: the reference of the ragged calls."""
KERNELS = {"cpu": Kernel("cpu", _cpu_forward, _cpu_backward, masks=True),
           "cuda": Kernel("cuda", _cuda_or_math(_cuda_ragged_forward, _ragged_math_forward),
                          _cuda_or_math(_cuda_ragged_backward, _ragged_math_backward),
                          masks=False, ragged=True)}


def fused_kernel(device: torch.device | str) -> Kernel:
    """The fused kernel of `device`'s type. Raises ValueError for a device type without one."""
    kind = torch.device(device).type
    if kind not in KERNELS:
        raise ValueError(f"CP attention has fused kernels for {sorted(KERNELS)}, not {kind!r}")
    return KERNELS[kind]
