"""Per-module runtime pieces the trainer joins into one step (docs/design.md 4.4, last bullet).

Each module reduces its gradients over its own DP x CP group (the LLM's sync is in
`hcp.train.step`; the encoder side's is `sync_grads` over the encoder's DP x CP group), every module
is scaled by the same global token count (the loss is divided once, before backward), the
gradient norm for clipping is global over every module and rank (`global_grad_norm`), and one
optimizer steps all modules together. `RankModules` puts this rank's modules under one root
whose parameter names are the single-process model's (`vision.*`, `projector.*`, `llm.*`), so
checkpoints and optimizer state are keyed by module FQN whatever the layouts.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from hcp.model.collectives import group_size


class RankModules(nn.Module):
    """This rank's modules under one root: the encoder side's `vision` and `projector`
    (`hcp.model.llava.LlavaEncoder`, None for a text-only LM; an `EncoderSide` adds its named
    encoders and projectors) and the LLM stage's `llm`."""

    def __init__(self, encoder, llm_stage):
        super().__init__()
        self.vision = encoder.vision if encoder is not None else None
        self.projector = encoder.projector if encoder is not None else None
        for name, child in encoder.named_children() if encoder is not None else ():
            if name not in ("vision", "projector"):  # named encoders and projectors (EncoderSide)
                self.add_module(name, child)
        self.llm = llm_stage.llm
        self.stage, self.cp_group = llm_stage.stage, llm_stage.cp_group  # what checkpoints label


def sync_grads(params, group) -> None:
    """Sum the gradients of the trainable `params` over `group` in one flat buffer (no-op for
    size 1). A parameter without a gradient joins with zeros, so every rank's buffer is the same.
    FSDP-sharded parameters (DTensors: a module under `dp_shard`) are left out: their backward
    already reduce-scattered them over the module's DP group."""
    params = [p for p in params if p.requires_grad and not isinstance(p, DTensor)]
    if group_size(group) == 1 or not params:
        return
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for p, synced in zip(params, _unflatten_dense_tensors(flat, grads)):
        if p.grad is None:
            p.grad = synced
        else:
            p.grad.copy_(synced)


def whole_state(module, tp_group) -> dict | None:
    """`module`'s parameters made whole on this rank, {FQN: tensor}: FSDP shards (DTensors)
    gathered over their DP group, then TP shards (with `shard_spec`) over `tp_group`; None when
    every parameter is whole here already (no TP group, no FSDP). Collectives over both groups
    in parameter order: every rank of the module calls it."""
    params = list(module.named_parameters())
    if tp_group is None and not any(isinstance(p, DTensor) for _, p in params):
        return None
    state = {}
    for name, p in params:
        t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        spec = getattr(p, "shard_spec", None)
        if spec is None:
            state[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(spec.world)]
        dist.all_gather(parts, t.contiguous(), group=tp_group)
        state[name] = torch.cat(parts, dim=spec.dim)
    return state


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (an FSDP shard's local tensor; a view, so in-place ops
    change the gradient)."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _squares(params, device) -> torch.Tensor:
    """[sum of squares of TP-sharded grads, of replicated grads] (float64) of local tensors:
    one fused `torch._foreach_norm` per kind (fp32 per tensor, as `clip_grad_norm_`), the
    squares summed in float64."""
    grads = ([], [])
    for p in params:
        if p.grad is not None:
            grads[0 if getattr(p, "shard_spec", None) else 1].append(_local(p.grad))
    return torch.stack([torch.stack(torch._foreach_norm(gs)).double().pow(2).sum() if gs else
                        torch.zeros((), dtype=torch.float64, device=device) for gs in grads])


def module_sq_norm(params, device, tp_group=None, shard_group=None, pp_group=None) -> torch.Tensor:
    """Squared L2 norm of one module's gradients over all its ranks (0-d float64, the same on
    every rank of the module): TP-sharded parameters (with `shard_spec`) summed over `tp_group`,
    replicated ones counted once; FSDP shards summed over `shard_group`; stages over `pp_group`.
    Collectives over the given groups (None: size 1)."""
    sq = _squares(params, device)
    if shard_group is not None and group_size(shard_group) > 1:
        dist.all_reduce(sq, group=shard_group)
    if tp_group is not None and group_size(tp_group) > 1:
        dist.all_reduce(sq[:1], group=tp_group)
    if pp_group is not None and group_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    return sq.sum()


def encoder_sq_norm(encoder, device, groups) -> torch.Tensor:
    """Squared L2 norm of the encoder side's gradients over all its ranks (0-d float64, the same
    on every rank): TP shards summed over the encoder's TP group and, for a module under
    `dp_shard` (FSDP; the encoder's children are named after their modules: `vision`,
    `projector`), the shards summed over that module's DP x CP group (`module_sq_norm`; the
    replicated modules together). Collectives in the same order on every rank (the sharding
    is a config fact)."""
    replicated, sq = [], torch.zeros((), dtype=torch.float64, device=device)
    for name, module in encoder.named_children():
        params = list(module.parameters())
        if any(isinstance(p, DTensor) for p in params):
            sq = sq + module_sq_norm(params, device, encoder.tp_group, groups.group(name, "dp_cp"))
        else:
            replicated += params
    return sq + module_sq_norm(replicated, device, encoder.tp_group)


def local_grad_sq(params) -> float:
    """Sum of squares of this rank's own gradient tensors (an FSDP shard's local part; no
    collective), e.g. to check that a rank got a gradient."""
    return sum(float(_local(p.grad).double().pow(2).sum()) for p in params if p.grad is not None)


def clip_(params, norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient by min(1, max_norm / norm) when max_norm > 0 (never up; norm: the
    global norm, a 0-d device tensor, float64, never read on the host), as torch's
    `clip_grads_with_norm_` does it: one fused `torch._foreach_mul_` per (device, dtype) of the
    local tensors (FSDP shards and plain gradients mix) with the scale in that dtype (a float64
    scale against fp32 gradients leaves the foreach kernel's fast path)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            grad = _local(p.grad)
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    if max_norm <= 0 or not groups:
        return
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for (device, dtype), grads in groups.items():
        torch._foreach_mul_(grads, scale.to(device, dtype))
