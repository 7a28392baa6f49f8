"""Sharded data parallelism (`llm.layout.dp_shard=true`) with torch's FSDP2 (`fully_shard`).

Parameters, gradients and AdamW state are sharded over the LLM's joint DP x CP group (a 1-D
`DeviceMesh` made from the existing process group): each decoder layer is one FSDP unit (its
parameters are all-gathered for its forward and backward and its gradients reduce-scattered
right after its backward), the root unit holds the rest of this stage (embedding, vision encoder
and projector on the first stage; final norm and LM head on the last).

Composition with the other parallelisms:
- TP: TP-sharded parameters are plain local tensors to FSDP (it shards each rank's TP slice
  over DP x CP); their `shard_spec` is re-attached to the new DTensor parameters so clipping and
  checkpoints still know them.
- Token-level loss: the loss is already divided by the global token count, so the gradients
  must be SUMMED over DP x CP, never averaged: the divide factor is 1 and the reduction a sum.
- PP / gradient accumulation: `StepRunner` turns gradient sync off for every micro-batch but the
  last (`set_requires_gradient_sync`), so each step reduce-scatters once.
- Unused parameters: a lane whose samples carry no image leaves the encoder and projector out
  of its graph; every unit reduce-scatters them anyway (zeros there,
  `set_reduce_scatter_unused_params`), so every rank's reduce-scatter has the same size.
- bf16: compute runs under autocast (`hcp.train.step`), so parameters, gradients and their
  reduction stay fp32.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard


def shard_model(model, groups) -> None:
    """Apply FSDP2 in place to this rank's `LlavaModel` stage over the LLM's `dp_cp` group.

    Raises RuntimeError when this torch's FSDP2 cannot reduce-scatter unused parameters (a lane
    without images would otherwise hang or fail the reduce-scatter).
    """
    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        raise RuntimeError(f"llm.layout.dp_shard=true needs FSDPModule.set_reduce_scatter_unused_params, "
                           f"which torch {torch.__version__} lacks: upgrade torch (2.13 has it) or "
                           "set llm.layout.dp_shard=false")
    specs = {n: p.shard_spec for n, p in model.named_parameters() if getattr(p, "shard_spec", None)}
    device = next(model.parameters()).device.type
    mesh = DeviceMesh.from_group(groups.group("llm", "dp_cp"), device_type=device)
    for layer in model.llm.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            module.set_reduce_scatter_unused_params(True)
    for name, p in model.named_parameters():
        if name in specs:
            p.shard_spec = specs[name]
