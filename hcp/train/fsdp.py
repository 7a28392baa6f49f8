"""Sharded data parallelism (`<module>.layout.dp_shard=true`) with torch's FSDP2 (`fully_shard`).

Each module shards over its own DP x CP group (`shard_model`: the LLM; `shard_encoder`: the
vision encoder and the projector, each on its own mesh, colocated on the same ranks).

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

The encoder side (`shard_encoder`) shards each module whose layout has `dp_shard` over that
module's DP x CP group (the encoder's lanes times its CP ranks, `vision.layout.cp`; under encoder TP each rank's TP slice is sharded, as
above): each ViT block is one unit, the `vision` root holds the patch and position embeddings and
the pre-norm; the projector is one unit. The encoder runs once per step (phase 1 of
`hcp.schedule.colocated`, recomputed in phase 3 under `recompute=full`) and backward once, so its
reduce-scatter runs once per step with no gradient-sync toggling. Every encoder lane runs that
forward and backward, also with no image (a `[0, C, H, W]` batch, whose zero gradients still
reach every parameter), so lanes with no or fewer images issue the same all-gathers and
reduce-scatters. Each module's root unit reshards after its forward too (FSDP keeps a root whole
by default): its backward comes only after the LLM's phase, which should not hold it whole.
Its gradients are summed like the LLM's (divide factor 1); the clipping norm
sums the shards' squares over the module's DP x CP group (`hcp.train.modules.encoder_sq_norm`).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from hcp.model.encoder_stage import EncoderStage


def shard_model(model, groups, device=None) -> None:
    """Apply FSDP2 in place to this rank's `LlavaModel` stage over the LLM's `dp_cp` group
    (nothing when this rank has none: `model` None on an encoder island). `device`: where the
    shards will live (default: where the parameters are; give it for a model still on the meta
    device, which `hcp.model.init.materialize` then makes: each rank allocates only its shard).

    Raises RuntimeError when this torch's FSDP2 cannot reduce-scatter unused parameters (a lane
    without images would otherwise hang or fail the reduce-scatter).
    """
    if model is None:  # an encoder island's rank (placement=non_colocated): no LLM stage here
        return
    _shard(model, list(model.llm.layers), groups.group("llm", "dp_cp"), "llm", device=device)


def shard_encoder(encoder, layouts: dict, groups, device=None) -> tuple[str, ...]:
    """Apply FSDP2 in place to the encoder-side modules of `encoder` (`hcp.model.llava.
    LlavaEncoder`: its children named after their modules, `vision`, `projector`) whose layout
    has `dp_shard`, each over its own DP x CP group (module docstring); an encoder island's stage
    (`EncoderStage`) as one, over its island's DP x CP group, when its encoder has `dp_shard`
    (`shard_island`: its projectors follow). `device`: as `shard_model`.
    Returns the names of the sharded modules (() when none asked for it, or no encoder).

    Raises RuntimeError as `shard_model`.
    """
    if encoder is None:
        return ()
    if isinstance(encoder, EncoderStage):  # an encoder island's stage (placement=non_colocated)
        if not layouts[encoder.name].dp_shard:
            return ()
        shard_island(encoder, groups.group(encoder.name, "dp_cp"), device)
        return (encoder.name, *encoder.projector_names)
    sharded = tuple(m for m, module in encoder.named_children()
                    if m in layouts and layouts[m].dp_shard and any(True for _ in module.parameters()))
    for m in sharded:
        module = encoder.get_submodule(m)
        blocks = getattr(module, "blocks", ())  # ViT blocks: a list, or a dict on a pipeline stage
        units = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
        _shard(module, units, groups.group(m, "dp_cp"), m, reshard_root=True, device=device)
    return sharded


def shard_island(stage, group, device=None) -> None:
    """Apply FSDP2 in place to one encoder island's stage (`hcp.model.encoder_stage.
    EncoderStage`, placement=non_colocated) over the island's DP x CP group: each ViT block and each
    projector one unit, the stage the root (the embeddings on the first stage), resharded after
    its forward. The island's schedule runs one forward and backward per micro-batch on every
    lane (empty ones included) and turns gradient sync on for the last backward only
    (`set_requires_gradient_sync`), so each step reduce-scatters once. Raises RuntimeError as
    `shard_model` (`device` too)."""
    blocks = getattr(stage.encoder, "blocks", ())
    units = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
    units += [getattr(stage, p) for p in stage.projector_names]
    _shard(stage, units, group, stage.name, reshard_root=True, device=device)


def _shard(root, units: list, group, name: str, reshard_root: bool | None = None,
           device=None) -> None:
    """`fully_shard` each of `units`, then `root` (the rest of its parameters), over `group`:
    gradients summed (divide factor 1), unused parameters reduce-scattered as zeros, and the
    TP `shard_spec` of every parameter carried over to its DTensor. `reshard_root`: FSDP's
    `reshard_after_forward` of the root (None: torch's default, kept whole after forward)."""
    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        raise RuntimeError(f"{name}.layout.dp_shard=true needs FSDPModule.set_reduce_scatter_unused_params, "
                           f"which torch {torch.__version__} lacks: upgrade torch (2.13 has it) or "
                           f"set {name}.layout.dp_shard=false")
    specs = {n: p.shard_spec for n, p in root.named_parameters() if getattr(p, "shard_spec", None)}
    kind = torch.device(device).type if device is not None else next(root.parameters()).device.type
    mesh = DeviceMesh.from_group(group, device_type=kind)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard_root)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            module.set_reduce_scatter_unused_params(True)
    for n, p in root.named_parameters():
        if n in specs:
            p.shard_spec = specs[n]
