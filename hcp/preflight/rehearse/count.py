"""FLOPs a rank counts in its step, per LLM micro-batch, next to the cost model's figure.

`flop_counter()` is torch's `FlopCounterMode` with formulas for the CPU flash-attention kernels
the fake-tensor ranks run (`hcp.model.cp_kernels`; torch registers only the CUDA ones, so
attention would count 0): torch's own SDPA counts, halved for a call with the causal mask
(its masked half of the score blocks is skipped). The backward counts what the flash backward
computes: 2.5 x its forward (the scores are recomputed). A call with an explicit mask counts in
full (its kernel scores every pair). `CostModel.micro_batch_flops` models the same
(`hcp.model.cp_attention.scored_pairs`, `hcp.dcp.cost_model.ATTENTION_BACKWARD`).

`per_micro_batch(counter)` attributes the counter's growth to the micro-batch whose forward
or backward ran it (every `hcp.schedule.executor.Executor`: the LLM's stages and, on an
encoder island, the encoder's); full recompute runs inside the backward, so it counts there.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from hcp.schedule.executor import Executor

_aten = torch.ops.aten


def _causal(flops: int, is_causal: bool) -> int:
    return flops // 2 if is_causal else flops


def _cpu_flash(query, key, value, dropout_p=0.0, is_causal=False, *args, out_shape=None,
               **kwargs) -> int:
    return _causal(sdpa_flop_count(query, key, value), is_causal)


def _cpu_flash_backward(grad_out, query, key, value, out, lse, dropout_p=0.0, is_causal=False,
                        *args, out_shape=None, **kwargs) -> int:
    return _causal(sdpa_backward_flop_count(grad_out, query, key, value), is_causal)


def _no_flops(*args, out_shape=None, **kwargs) -> int:
    return 0


UNDECOMPOSED = (_aten.silu_backward.default,)
"""Elementwise ops `FlopCounterMode` would run as their decomposition (it decomposes every op
it has no formula for), whose temporaries the real kernel never allocates: SwiGLU's
`silu_backward` raised a tracked peak by 10%. Mapped to 0 FLOPs (their decompositions count
none; the key is the overload, which its decomposition check looks up), they run as in
training."""


def flop_counter() -> FlopCounterMode:
    """A `FlopCounterMode` (no display) that also counts the CPU flash-attention kernels and
    runs `UNDECOMPOSED` as themselves."""
    return FlopCounterMode(display=False, custom_mapping={
        _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
        _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
        **{op: _no_flops for op in UNDECOMPOSED}})


@contextlib.contextmanager
def per_micro_batch(counter: FlopCounterMode):
    """While active, every `Executor`'s forward and backward of micro-batch i add the FLOPs
    `counter` counted in them to the yielded dict's `[i]` (FLOPs; one run's executors share
    the indices: a rank runs one LLM stage)."""
    flops: dict[int, int] = defaultdict(int)
    init, backward = Executor.__init__, Executor._backward

    def counted(fn, i, *args):
        before = counter.get_total_flops()
        out = fn(*args)
        flops[i] += counter.get_total_flops() - before
        return out

    def counted_init(self, forward, *args, **kwargs):
        init(self, lambda i, x: counted(forward, i, i, x), *args, **kwargs)

    def counted_backward(self, i):
        return counted(backward, i, self, i)

    Executor.__init__, Executor._backward = counted_init, counted_backward
    try:
        yield flops
    finally:
        Executor.__init__, Executor._backward = init, backward
