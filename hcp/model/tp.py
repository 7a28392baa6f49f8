"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019; sequence parallelism, Korthikanti
et al. 2022): column- and row-parallel linear layers, a vocab-parallel embedding and a
vocab-parallel cross-entropy that never gathers the full logits.

Every layer takes `tp_group: ProcessGroup | None` (None = TP size 1: a plain layer) and marks its
sharded parameters with a `shard_spec` (`hcp.model.init.ShardSpec`), so `init_parameters` draws
the whole tensor from (seed, name) and keeps this rank's slice: init is layout-invariant.
With `sequence_parallel`, activations outside the TP region are split along tokens
(`[T / tp, H]`): column-parallel layers all-gather their input, row-parallel layers
reduce-scatter their output.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hcp.model.collectives import (copy_to_group, gather_seq, group_rank, group_size,
                                   reduce_from_group, reduce_scatter_seq)
from hcp.model.init import ShardSpec


def _split(size: int, tp_group, what: str) -> int:
    world = group_size(tp_group)
    if size % world:
        raise ValueError(f"{what} ({size}) must be divisible by the TP size ({world})")
    return size // world


def _mark(param: nn.Parameter, dim: int, tp_group) -> None:
    if group_size(tp_group) > 1:
        param.shard_spec = ShardSpec(dim, group_rank(tp_group), group_size(tp_group))


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split over TP: x [T, in] (or [T / tp, in] under
    sequence parallelism) -> this rank's y columns [T, out / tp]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        local = _split(out_features, tp_group, "column-parallel output features")
        self.weight = nn.Parameter(torch.empty(local, in_features))
        _mark(self.weight, 0, tp_group)
        self.bias = nn.Parameter(torch.zeros(local)) if bias else None
        if bias:
            _mark(self.bias, 0, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (gather_seq(x, self.tp_group)
             if self.sequence_parallel else copy_to_group(x, self.tp_group))
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split over TP: x [T, in / tp] -> y [T, out] summed
    over TP (or this rank's token slice [T / tp, out] under sequence parallelism)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features,
                                               _split(in_features, tp_group,
                                                      "row-parallel input features")))
        _mark(self.weight, 1, tp_group)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_seq(y, self.tp_group)
            # the bias sees only this rank's tokens: its gradient is summed over TP
            return y if self.bias is None else y + copy_to_group(self.bias, self.tp_group)
        y = reduce_from_group(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows over TP: ids long [T] -> [T, H] (each rank looks
    up the ids in its row range, zeros elsewhere, summed over TP)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group=None):
        super().__init__()
        self.tp_group = tp_group
        local = _split(num_embeddings, tp_group, "vocab_size")
        self.vocab_start = group_rank(tp_group) * local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim))
        _mark(self.weight, 0, tp_group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return reduce_from_group(out * inside[:, None].to(out.dtype), self.tp_group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocab-sharded logits: three all-reduces of [T] vectors
    (max, sum of exp, target logit) instead of gathering [T, V]."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        logits = logits.float()
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max[:, None]
        local = target - vocab_start
        inside = (local >= 0) & (local < logits.shape[-1])
        local = local.clamp(0, logits.shape[-1] - 1)
        target_logit = shifted.gather(1, local[:, None]).squeeze(1) * inside
        dist.all_reduce(target_logit, group=group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        ctx.save_for_backward(exp / sum_exp[:, None], local, inside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(1, local[:, None], -inside.to(softmax.dtype)[:, None])
        return grad_logits * grad[:, None], None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 tp_group=None) -> torch.Tensor:
    """Per-token loss [T] (fp32) from this rank's logits [T, V / tp] and global targets long [T]
    (every target must be a real id: drop ignored tokens first)."""
    if group_size(tp_group) == 1:
        return F.cross_entropy(logits.float(), target, reduction="none")
    vocab_start = group_rank(tp_group) * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, tp_group)
