"""Cost model: time of a packed group of sequences on `c` CP ranks, per pipeline stage.

Built from the run's own LLM config (`llm.*`: shape and `llm.layout` tp, pp, pp_layers,
recompute) and a hardware profile (`hcp.dcp.hardware`: profiles/h100.yaml, or one fitted by
`mode=calibrate`).
FLOPs per layer and of the LM head come from hcp/model/flops.py (the one implementation):
matmuls `2 T P_layer`, ragged causal attention `2 h sum_i L_i^2`, head `2 T h V` on the last
stage. TP of size tp splits every matmul and every head's attention over tp GPUs, so compute
divides by tp; under CP of size c every rank holds T / c tokens (zigzag chunks balance the
causal work), so compute divides by c. Ring attention moves each rank's K and V shards to the
c - 1 others: `T (c - 1) / c * 2 d_kv / tp * bytes` per GPU and layer. The ranks of a CP pool
are strided by TP (docs/design.md section 3: tp fastest), so a CP group of c ranks spans c * tp GPUs
and stays on NVLink only when `c * tp <= ranks_per_node`; above, InfiniBand. A fraction
`comm_overlap` of the traffic can hide behind the attention kernels (ring attention overlaps
block transfers with block compute; FlexSP and ByteScale model CP time the same way:
`(a L^2 + b L) / c + comm`), never more than the attention time itself:
exposed = max((1 - overlap) * comm, comm - attention). Each CP collective also pays a latency
per ring step (the alpha of the alpha-beta model of a ring collective of c ranks, Thakur,
Rabenseifner and Gropp 2005: `alpha (c - 1) + beta bytes (c - 1) / c`): `cp_latency * (c - 1)`
per layer and micro-batch, never hidden (each step waits for the previous one), plus a fixed
`cp_overhead[c]` per layer and micro-batch (CP attention's calls and set-up). Both are per
micro-batch, not per token, so the additive floor `fwd_floor` leaves them out. TP's own
collectives are linear in the tokens and left to the matmul coefficient (a calibrated profile
absorbs them).
The attention coefficient may depend on c (`cp_attention_efficiency`: CP attention's kernels
at c > 1 are not the fused SDPA of c = 1; `CostModel.attn_scale`).
Backward is twice the forward (compute and K/V plus dK/dV traffic), full recompute adds one
forward: `bwd = (2 + recompute) * fwd` (`bwd_factor`); selective recompute adds the attention
core's forward (`core_fwd`: its scores, exposed K/V traffic and CP latency, what
`hcp.model.llama.Attention` checkpoints; `stage_times` prices it, the dynamic-CP policy plans
without it: `hcp.dcp.policy.planned_recompute`).
Each micro-batch also pays a fixed overhead per stage.

All times are seconds, FLOPs are floating-point operations, bytes are bytes, tokens are tokens.
Arrays broadcast: `tokens`, `sq` (sum of squared lengths, tokens^2) and `c` of one shape S give
results of shape `[pp, *S]`.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import replace
from pathlib import Path

import numpy as np

from hcp.config.errors import ConfigError, check_choice
from hcp.config.layouts import RECOMPUTES
from hcp.dcp.hardware import HardwareProfile, at_cp_size, load_profile
from hcp.dcp.packing import Packing
from hcp.model.flops import (head_flops_per_token, kv_dim, layer_attention_flops_per_sq_token,
                             layer_matmul_flops_per_token, layer_recompute_matmul_flops_per_token,
                             model_flops)

ATTENTION_BACKWARD = 2.5
"""Backward FLOPs of fused (flash) attention per forward FLOP: it recomputes the scores, five
matmuls of the forward's size against the forward's two (Dao 2023)."""


class CostModel:
    """Per-stage forward/backward time of packed groups for the LLM `llm` (an `LLMConfig`, or
    any object with its shape fields and a `layout` with tp, pp, pp_layers, recompute).

    `pp`, `tp`, `recompute` (`none`, `selective` or `full`) and `pp_layers` (layers per stage)
    default to `llm.layout`'s; give them to model another layout of the same model. Layers are
    split by `pp_layers`, else as evenly as possible (earlier stages take the remainder); the last
    stage also runs the LM head.

    Raises:
        ConfigError: pp outside [1, num_layers], tp < 1, pp_layers not summing to num_layers,
            or an unknown recompute.
    """

    def __init__(self, llm, hw: HardwareProfile, pp: int | None = None, tp: int | None = None,
                 recompute: str | None = None, pp_layers: list[int] | None = None):
        layout = getattr(llm, "layout", None)
        pp = int(pp if pp is not None else getattr(layout, "pp", 1))
        tp = int(tp if tp is not None else getattr(layout, "tp", 1))
        recompute = recompute if recompute is not None else getattr(layout, "recompute", "none")
        check_choice("recompute", recompute, RECOMPUTES)
        if pp_layers is None and layout is not None and getattr(layout, "pp", None) == pp:
            pp_layers = getattr(layout, "pp_layers", None)
        layers = llm.num_layers
        if pp < 1 or pp > layers:
            raise ConfigError("pp", pp, f"every stage needs one of the {layers} layers",
                              f"use 1 <= pp <= {layers}")
        if tp < 1:
            raise ConfigError("tp", tp, "TP size must be >= 1", "use a positive integer")
        if pp_layers is not None:
            n = np.asarray(list(pp_layers), dtype=np.float64)
            if n.size != pp or n.sum() != layers or (n < 1).any():
                raise ConfigError("pp_layers", list(pp_layers), f"must give {pp} positive "
                                  f"counts summing to num_layers={layers}",
                                  "fix llm.layout.pp_layers")
        else:
            n = np.full(pp, layers // pp, dtype=np.float64)
            n[: layers % pp] += 1
        self.llm, self.hw, self.pp, self.tp, self.recompute = llm, hw, pp, tp, recompute
        head = np.zeros(pp)
        head[-1] = 1.0
        self.head_flops = head * head_flops_per_token(llm)  # / token
        self.mm_flops = n * layer_matmul_flops_per_token(llm) + self.head_flops  # / token
        self.attn_flops = n * layer_attention_flops_per_sq_token(llm)  # / token^2
        self.recompute_mm_flops = n * layer_recompute_matmul_flops_per_token(llm)  # / token
        self.mm_coef = self.mm_flops / tp / (hw.peak_flops * hw.matmul_efficiency)  # s / token
        self.attn_coef = (self.attn_flops / tp
                          / (hw.peak_flops * hw.attention_efficiency))  # s / token^2 at c = 1
        self.comm_coef = n * 2 * kv_dim(llm) / tp * hw.bytes_per_element  # bytes / token / GPU
        self.latency_coef = n * hw.cp_latency  # s per ring step (c - 1) and micro-batch
        self.cp_layers = n  # layers per stage: they pay `hw.cp_overhead` per micro-batch
        self.bwd_factor = 2.0 + float(recompute == "full")
        """Backward / forward seconds as the planners' bounds (`hcp.dcp.solver`) take it: 3
        under full recompute, else 2 (selective's core forward: `stage_times` only)."""

    def bandwidth(self, c):
        """Bytes/s of a CP group of c ranks: NVLink while its c * tp GPUs fit in one node."""
        return np.where(np.asarray(c) * self.tp <= self.hw.ranks_per_node,
                        self.hw.nvlink_bandwidth, self.hw.ib_bandwidth)

    def attn_scale(self, c):
        """Factor of `attn_coef` (the c = 1 coefficient) at CP sizes `c` (array of c's shape,
        or 1.0 without `cp_attention_efficiency`): attention_efficiency / the efficiency at c
        (`HardwareProfile.cp_attention_efficiency`), 1 at c = 1."""
        eff = at_cp_size(self.hw.cp_attention_efficiency, c)
        if eff is None:
            return 1.0
        return np.where(np.asarray(c) > 1, self.hw.attention_efficiency / eff, 1.0)

    def _parts(self, tokens, sq, c):
        t, s, c = (np.asarray(x, dtype=np.float64) for x in (tokens, sq, c))
        col = (slice(None),) + (None,) * max(t.ndim, s.ndim, c.ndim)
        attn_coef = self.attn_coef[col] * self.attn_scale(c)
        compute = (self.mm_coef[col] * t + attn_coef * s) / c
        attn = attn_coef * s / c
        comm = self.comm_coef[col] * t * (c - 1) / c / self.bandwidth(c)
        return compute, attn, comm

    def latency(self, c) -> np.ndarray:
        """Forward seconds `[pp, *S]` one micro-batch on a group of `c` ranks (shape S) pays
        whatever its tokens: the collectives' ring steps `cp_latency * layers * (c - 1)` plus
        `cp_overhead[c] * layers`; 0 at c = 1."""
        c = np.asarray(c, dtype=np.float64)
        col = (slice(None),) + (None,) * c.ndim
        lat = self.latency_coef[col] * (c - 1.0)
        fixed = at_cp_size(self.hw.cp_overhead, c)
        if fixed is None:
            return lat
        return lat + self.cp_layers[col] * np.where(c > 1, fixed, 0.0)

    def fwd(self, tokens, sq, c) -> np.ndarray:
        """Forward seconds `[pp, *S]` of groups with `tokens`, `sq` on `c` ranks (no overhead):
        compute, exposed K/V traffic and the collectives' latency."""
        compute, attn, comm = self._parts(tokens, sq, c)
        return self._with_comm(compute, attn, comm, tokens, c)

    def core_fwd(self, tokens, sq, c) -> np.ndarray:
        """Forward seconds `[pp, *S]` of the attention core alone (`fwd` less the matmuls: the
        scores, the exposed K/V traffic and the collectives' latency), what selective
        recompute runs again in backward."""
        _, attn, comm = self._parts(tokens, sq, c)
        return self._with_comm(attn, attn, comm, tokens, c)

    def _with_comm(self, compute, attn, comm, tokens, c) -> np.ndarray:
        """`compute` plus the K/V traffic not hidden behind `attn` and the latency."""
        exposed = np.maximum((1.0 - self.hw.comm_overlap) * comm, comm - attn)
        if not (self.hw.cp_latency or self.hw.cp_overhead):
            return compute + exposed
        return compute + exposed + np.where(np.asarray(tokens) > 0, self.latency(c), 0.0)

    def fwd_floor(self, tokens, sq, c) -> np.ndarray:
        """Additive lower envelope of `fwd`: compute + (1 - overlap) * comm, `[pp, *S]` seconds.

        `fwd(group) >= sum over its sequences of fwd_floor(L_i, L_i^2, c)`: every term is linear
        in (tokens, sq) and the exposed communication is never below `(1 - overlap) * comm`;
        the latency (once per micro-batch, >= 0) is left out.
        """
        compute, _, comm = self._parts(tokens, sq, c)
        return compute + (1.0 - self.hw.comm_overlap) * comm

    def one_stage(self, how: str) -> "CostModel":
        """This model as one pipeline stage (pp = 1), a surrogate for planning pipelines with the
        one-stage searches: `how="sum"` sums the stages' coefficients and overheads (a
        micro-batch's time is then its whole critical path through the pipeline, exact for a
        single micro-batch), `how="max"` takes each coefficient's largest stage (the steady
        state's slowest stage: a sum over many micro-batches). ValueError for another `how`."""
        if how not in ("sum", "max"):
            raise ValueError(f"how={how!r}: use 'sum' or 'max'")
        out = copy.copy(self)
        agg = np.sum if how == "sum" else np.max
        for name in ("mm_coef", "attn_coef", "comm_coef", "latency_coef", "cp_layers"):
            setattr(out, name, np.atleast_1d(agg(getattr(self, name))))
        scale = self.pp if how == "sum" else 1
        out.hw = replace(self.hw, micro_batch_overhead_fwd=scale * self.hw.micro_batch_overhead_fwd,
                         micro_batch_overhead_bwd=scale * self.hw.micro_batch_overhead_bwd)
        out.pp = 1
        return out

    def micro_batch_flops(self, local_tokens: float, pairs: float, recompute: str | None = None,
                          head_rows: float | None = None) -> np.ndarray:
        """FLOPs `[pp]` one rank of each stage computes for a micro-batch as the code runs it:
        `local_tokens` the rows of its CP shard (padding included, `rank_tokens`), `pairs` the
        query-key pairs its attention calls score (`hcp.model.cp_attention.scored_pairs`),
        `head_rows` the rows the last stage's LM head scores (the loss tokens when the loss
        picks them; None: every local row), split over tp. Matmuls forward and twice that
        backward, attention forward and `ATTENTION_BACKWARD` times that backward; `recompute`
        (`none`, `selective`, `full`; None: this model's) re-runs the attention forward and,
        when `full`, the layers' matmuls but the last (`layer_recompute_matmul_flops_per_token`).
        Not the time model's FLOPs (`bwd_factor`: its efficiencies were fitted with
        backward = 2 x)."""
        recompute = recompute or self.recompute
        rows = local_tokens if head_rows is None else head_rows
        mm = ((self.mm_flops - self.head_flops) * local_tokens + self.head_flops * rows) / self.tp
        attn = self.attn_flops * 2.0 * pairs / self.tp  # attn_flops: per token^2, causal (2 pairs)
        redo = self.recompute_mm_flops * local_tokens / self.tp if recompute == "full" else 0.0
        return 3.0 * mm + redo + (1.0 + ATTENTION_BACKWARD + (recompute != "none")) * attn

    def model_flops(self, lengths) -> float:
        """Model FLOPs of one training step on these sequences (hcp/model/flops.py)."""
        arr = np.asarray(lengths, dtype=np.float64)
        return model_flops(self.llm, float(arr.sum()), float((arr**2).sum()))

    def stage_times(self, plan: Packing, lengths) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward seconds `[pp, R]` of each round on each stage.

        A group's time in a round is the sum over its micro-batches q of `(1 + k) f(q)` (plus
        `core_fwd(q)` under selective recompute) and the overheads `o_f + o_b` of each; the
        round lasts as long as its slowest group (the pool synchronises between rounds).
        Forward: the largest `sum_q f(q) + o_f` of a group, backward: the round's length minus
        that; with one micro-batch per group (PP, dp_shard) these are the slowest group's
        forward and backward exactly, and at pp = 1 their sum is the round's length."""
        arr = np.asarray(lengths, dtype=np.float64)
        members, cs, gids, rounds = [], [], [], []
        ngroups = 0
        for j, r in enumerate(plan.rounds):
            for g in r.groups:
                mbs = g.micro_batches
                if mbs:
                    members += mbs
                    cs += [g.cp_size] * len(mbs)
                    gids += [ngroups] * len(mbs)
                    rounds.append(j)
                    ngroups += 1
        sizes = np.fromiter(map(len, members), dtype=np.int64, count=len(members))
        seqs = np.fromiter((i for idx in members for i in idx), dtype=np.int64, count=sizes.sum())
        qid = np.repeat(np.arange(len(members)), sizes)
        x = arr[seqs]
        tok = np.bincount(qid, weights=x, minlength=len(members))
        sq = np.bincount(qid, weights=x * x, minlength=len(members))
        cs = np.array(cs)
        f = self.fwd(tok, sq, cs)  # [pp, Q]
        gid = np.array(gids)
        fsum = np.zeros((self.pp, ngroups))
        np.add.at(fsum, (slice(None), gid), f)
        nmb = np.bincount(gid, minlength=ngroups)
        o_f, o_b = self.hw.micro_batch_overhead_fwd, self.hw.micro_batch_overhead_bwd
        g_fwd = fsum + nmb * o_f
        g_all = (1.0 + self.bwd_factor) * fsum + nmb * (o_f + o_b)
        if self.recompute == "selective":  # backward runs the attention core's forward again
            np.add.at(g_all, (slice(None), gid), self.core_fwd(tok, sq, cs))
        fwd = np.zeros((self.pp, plan.num_rounds))
        total = np.zeros((self.pp, plan.num_rounds))
        rid = np.array(rounds)
        np.maximum.at(fwd, (slice(None), rid), g_fwd)
        np.maximum.at(total, (slice(None), rid), g_all)
        return fwd, total - fwd


@functools.lru_cache(maxsize=None)
def recipe_llm(recipe: str = "llama13b_dynamic_cp"):
    """The `llm` config (shape and layout) of `python train.py +recipe=RECIPE`: the benchmark's
    and the tests' model comes from the recipe, not from a copy of its numbers."""
    from hcp.config.compose import compose_config

    return compose_config([f"+recipe={recipe}"]).llm


def load_cost(llm, profile: str | Path = "h100", **layout) -> CostModel:
    """`CostModel(llm, load_profile(profile), **layout)`; `layout` overrides pp, tp,
    recompute, pp_layers."""
    return CostModel(llm, load_profile(profile), **layout)
