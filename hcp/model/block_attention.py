"""Block-wise attention with an online softmax (flash attention, Dao et al. 2022; Dao 2023),
pure torch: the reference kernel of CP attention, on any device.

The work is a list of `TileBatch`es: n tiles that share one shape `[bq, bk]` and one mask. A tile
pairs `bq` query rows with `bk` key rows; only tiles that causality does not fully mask are ever
listed (the CP plan, `hcp.model.cp_attention`, builds them). Tiles of a batch are computed
together in chunks whose scores hold at most `max(SCORE_BUDGET, one tile)` elements, so the
memory of a call is its inputs plus O(block^2 x heads), never O(T x T_k).

Per query row the running max `m`, sum `l` and output accumulator `o` are fp32 whatever the input
dtype (bf16 inputs are upcast tile by tile), and the tiles' contributions are merged with the
online-softmax rescaling `exp(m_old - m_new)`. The forward returns `out = o / l` in the input
dtype and the log-sum-exp `lse = m + log(l)` in fp32 (-inf for a row that saw no key). The
backward recomputes each tile's probabilities from `lse` (flash backward:
`dS = P * (dP - rowsum(dO * O))`) and accumulates dq, dk, dv in fp32.

Shapes: q `[Tq, Hq, D]`, k, v `[Tk, Hkv, D]`, Hq a multiple of Hkv (grouped-query attention:
query head h reads kv head h // (Hq / Hkv)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCORE_BUDGET = 1 << 22
"""Score elements (fp32) computed at once per chunk of tiles: 16 MiB, a few such temporaries."""


@dataclass
class TileBatch:
    """n tiles of one shape. Every query row of a tile sees only the key rows of the same tile
    where `mask` is True (None: all of them)."""

    q_rows: torch.Tensor
    """long [n, bq]: query rows (indices into q) of each tile."""
    k_rows: torch.Tensor
    """long [n, bk]: key rows (indices into k and v) of each tile."""
    mask: torch.Tensor | None
    """bool [bq, bk] shared by the n tiles (True = attend), or None."""

    def chunks(self, heads: int):
        """Yield (q_rows, k_rows) of at most max(1, SCORE_BUDGET // (heads * bq * bk)) tiles."""
        n, bq = self.q_rows.shape
        step = max(1, SCORE_BUDGET // max(1, heads * bq * self.k_rows.shape[1]))
        for s in range(0, n, step):
            yield self.q_rows[s:s + step], self.k_rows[s:s + step]


@dataclass
class SoftmaxState:
    """Running online-softmax statistics of Tq query rows, fp32 (`acc_dtype`)."""

    m: torch.Tensor
    """[Tq, Hq]: running max of the scaled scores (-inf: no key yet)."""
    l: torch.Tensor  # noqa: E741 - the paper's name
    """[Tq, Hq]: running sum of exp(score - m)."""
    o: torch.Tensor
    """[Tq, Hq, D]: running sum of exp(score - m) * v."""

    @classmethod
    def empty(cls, q: torch.Tensor) -> "SoftmaxState":
        t, h, d = q.shape
        f32 = dict(dtype=acc_dtype(q.dtype), device=q.device)
        return cls(torch.full((t, h), float("-inf"), **f32), torch.zeros(t, h, **f32),
                   torch.zeros(t, h, d, **f32))

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [Tq, Hq, D] in `dtype`, lse [Tq, Hq] fp32); rows that saw no key: 0 and -inf."""
        seen = self.l > 0
        out = self.o / torch.where(seen, self.l, 1.0)[..., None]
        lse = torch.where(seen, self.m + torch.log(torch.where(seen, self.l, 1.0)), float("-inf"))
        return out.to(dtype), lse


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of statistics and accumulators: fp32, or fp64 for fp64 inputs (tests)."""
    return torch.promote_types(dtype, torch.float32)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """-inf (no key) -> 0, so that exp(-inf - 0) = 0 instead of exp(-inf + inf) = nan."""
    return torch.where(torch.isinf(x), 0.0, x)


def _gather(q, k, v, qr, kr, hkv):
    """Tiles' rows, fp32: Q [n, Hkv, g, bq, D], K, V [n, Hkv, 1, bk, D]."""
    n, bq = qr.shape
    d = q.shape[-1]
    acc = acc_dtype(q.dtype)
    qt = q[qr].to(acc).view(n, bq, hkv, -1, d).permute(0, 2, 3, 1, 4)
    kt, vt = (x[kr].to(acc).permute(0, 2, 1, 3).unsqueeze(2) for x in (k, v))
    return qt, kt, vt


def _scores(qt, kt, mask, scale):
    s = torch.matmul(qt, kt.transpose(-1, -2)).mul_(scale)               # [n, Hkv, g, bq, bk]
    return s if mask is None else s.masked_fill_(~mask, float("-inf"))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[n, Hkv, g, bq, ...] -> [n * bq, Hq, ...] (query-row major)."""
    n, hkv, g, bq = x.shape[:4]
    return x.permute(0, 3, 1, 2, *range(4, x.dim())).reshape(n * bq, hkv * g, *x.shape[4:])


def _tiles(x: torch.Tensor, qr: torch.Tensor, hkv: int) -> torch.Tensor:
    """Per-row x [Tq, Hq, ...] -> [n, Hkv, g, bq, ...] at the tiles' query rows."""
    n, bq = qr.shape
    t = x[qr]                                                             # [n, bq, Hq, ...]
    t = t.view(n, bq, hkv, -1, *x.shape[2:])
    return t.permute(0, 2, 3, 1, *range(4, t.dim()))


def forward_tiles(state: SoftmaxState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  tiles: list[TileBatch]) -> None:
    """Fold the tiles' keys into `state` (in place). q [Tq, Hq, D], k, v [Tk, Hkv, D].
    Runs with autocast off, so the tiles stay in the accumulation dtype under `precision=bf16`."""
    with torch.autocast(q.device.type, enabled=False):
        _forward_tiles(state, q, k, v, tiles)


def _forward_tiles(state, q, k, v, tiles) -> None:
    hkv, scale = k.shape[1], 1.0 / math.sqrt(q.shape[-1])
    for batch in tiles:
        for qr, kr in batch.chunks(q.shape[1]):
            qt, kt, vt = _gather(q, k, v, qr, kr, hkv)
            s = _scores(qt, kt, batch.mask, scale)
            idx = qr.reshape(-1)
            row_max = _rows(s.amax(-1))                                   # [n * bq, Hq]
            m_new = state.m.scatter_reduce(0, idx[:, None].expand_as(row_max), row_max, "amax")
            safe = _finite(m_new)
            p = torch.exp(s.sub_(_tiles(safe, qr, hkv)[..., None]))
            alpha = torch.exp(state.m - safe)                             # 0 where m was -inf
            state.l = (state.l * alpha).index_add_(0, idx, _rows(p.sum(-1)))
            state.o = (state.o * alpha[..., None]).index_add_(0, idx, _rows(torch.matmul(p, vt)))
            state.m = m_new


def backward_tiles(q, k, v, dout, lse, delta, tiles, dq, dk, dv) -> None:
    """Add the tiles' gradients to the fp32 accumulators dq [Tq, Hq, D], dk, dv [Tk, Hkv, D].

    dout [Tq, Hq, D]; lse, delta = rowsum(dout * out) [Tq, Hq] fp32 (flash backward, Dao 2022).
    Runs with autocast off (see `forward_tiles`).
    """
    with torch.autocast(q.device.type, enabled=False):
        _backward_tiles(q, k, v, dout, lse, delta, tiles, dq, dk, dv)


def _backward_tiles(q, k, v, dout, lse, delta, tiles, dq, dk, dv) -> None:
    hkv, scale = k.shape[1], 1.0 / math.sqrt(q.shape[-1])
    lse = _finite(lse)
    for batch in tiles:
        for qr, kr in batch.chunks(q.shape[1]):
            qt, kt, vt = _gather(q, k, v, qr, kr, hkv)
            p = torch.exp(_scores(qt, kt, batch.mask, scale).sub_(_tiles(lse, qr, hkv)[..., None]))
            do = _tiles(dout, qr, hkv).to(qt.dtype)                           # [n, Hkv, g, bq, D]
            ds = torch.matmul(do, vt.transpose(-1, -2))                   # dP
            ds = p * ds.sub_(_tiles(delta, qr, hkv)[..., None]).mul_(scale)
            kidx = kr.reshape(-1)
            dv.index_add_(0, kidx, torch.matmul(p.transpose(-1, -2), do).sum(2)
                          .transpose(1, 2).reshape(-1, hkv, q.shape[-1]))
            dk.index_add_(0, kidx, torch.matmul(ds.transpose(-1, -2), qt).sum(2)
                          .transpose(1, 2).reshape(-1, hkv, q.shape[-1]))
            dq.index_add_(0, qr.reshape(-1), _rows(torch.matmul(ds, kt)))


class BlockAttention(torch.autograd.Function):
    """`BlockAttention.apply(q, k, v, tiles)` -> out [Tq, Hq, D]: every query row attends to the
    key rows its tiles list (rows listed in no tile return zeros). Exact in values and gradients;
    statistics and gradient accumulators fp32."""

    @staticmethod
    def forward(ctx, q, k, v, tiles):
        state = SoftmaxState.empty(q)
        forward_tiles(state, q, k, v, tiles)
        out, lse = state.result(q.dtype)
        ctx.tiles = tiles
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        acc = acc_dtype(q.dtype)
        delta = (dout.to(acc) * out.to(acc)).sum(-1)
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        backward_tiles(q, k, v, dout, lse, delta, ctx.tiles, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
