"""Sharded data parallelism (`<module>.layout.dp_shard=true`) with torch's FSDP2 (`fully_shard`).

Each module shards over its own DP x CP group (`shard_model`: the LLM, one FSDP unit per decoder
layer plus the stage's root; `shard_encoder`: the vision encoder, one unit per ViT block, and
the projector, each on its own mesh). TP-sharded parameters keep their `shard_spec` on the new
DTensors (clipping, checkpoints). Gradients are SUMMED over DP x CP (divide factor 1: the loss
is already token-level). `trainer.fsdp_reduce` says when they are reduce-scattered (`grad_sync`):
every backward (`per_micro_batch`, the default), or the last micro-batch's only (`per_step`:
torch then keeps each parameter's whole fp32 gradient from the first backward to the last;
docs/memory.md).
Every unit reduce-scatters unused parameters too (a lane with no image), and every encoder lane
runs its forward and backward even with no image, so all ranks issue the same collectives. An
encoder's root reshards after its forward (its backward comes after the LLM's phase)."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from hcp.config.precision import Precision
from hcp.model.encoder_stage import EncoderStage


def grad_sync(module, fsdp_reduce: str):
    """The `grad_sync(enabled)` a schedule calls around its backward passes (`hcp.schedule.
    executor.Executor`) for the FSDP-sharded `module` under `trainer.fsdp_reduce`: its
    `set_requires_gradient_sync` under `per_step` (off until the last backward), None under
    `per_micro_batch` (sync stays on: every backward reduce-scatters into the gradient shard)."""
    return module.set_requires_gradient_sync if fsdp_reduce == "per_step" else None


def shard_model(model, groups, device=None, precision: Precision | str = "fp32") -> None:
    """Apply FSDP2 in place to this rank's `LlavaModel` stage over the LLM's `dp_cp` group
    (nothing when this rank has none: `model` None on an encoder island). `device`: where the
    shards will live (default: where the parameters are; give it for a model still on the meta
    device, which `hcp.model.init.materialize` then makes: each rank allocates only its shard).
    `precision`: the run's (`Precision.fsdp_policy`: layers all-gather in its compute dtype).

    Raises RuntimeError when this torch's FSDP2 cannot reduce-scatter unused parameters (a lane
    without images would otherwise hang or fail the reduce-scatter).
    """
    if model is None:  # an encoder island's rank (placement=non_colocated): no LLM stage here
        return
    _shard(model, list(model.llm.layers), groups.group("llm", "dp_cp"), "llm", device=device,
           precision=precision)


def shard_encoder(encoder, layouts: dict, groups, device=None,
                  precision: Precision | str = "fp32") -> tuple[str, ...]:
    """Apply FSDP2 in place to the encoder-side modules of `encoder` (`hcp.model.llava.
    LlavaEncoder`: its children named after their modules, `vision`, `projector`) whose layout
    has `dp_shard`, each over its own DP x CP group (module docstring); an encoder island's stage
    (`EncoderStage`) as one, over its island's DP x CP group, when its encoder has `dp_shard`
    (`shard_island`: its projectors follow). `device`, `precision`: as `shard_model`.
    Returns the names of the sharded modules (() when none asked for it, or no encoder).

    Raises RuntimeError as `shard_model`.
    """
    if encoder is None:
        return ()
    if isinstance(encoder, EncoderStage):  # an encoder island's stage (placement=non_colocated)
        if not layouts[encoder.name].dp_shard:
            return ()
        shard_island(encoder, groups.group(encoder.name, "dp_cp"), device, precision)
        return (encoder.name, *encoder.projector_names)
    sharded = tuple(m for m, module in encoder.named_children()
                    if m in layouts
                    and layouts[m].dp_shard and any(True for _ in module.parameters()))
    for m in sharded:
        module = encoder.get_submodule(m)
        blocks = getattr(module, "blocks", ())  # ViT blocks: a list, or a dict on a pipeline stage
        units = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
        _shard(module, units, groups.group(m, "dp_cp"), m, reshard_root=True, device=device,
               precision=precision)
    return sharded


def shard_island(stage, group, device=None, precision: Precision | str = "fp32") -> None:
    """Apply FSDP2 in place to one encoder island's stage (`hcp.model.encoder_stage.
    EncoderStage`, placement=non_colocated) over the island's DP x CP group: each ViT block and each
    projector one unit, the stage the root (the embeddings on the first stage), resharded after
    its forward. The island's schedule runs one forward and backward per micro-batch on every
    lane (empty ones included), so every rank reduce-scatters as often (`grad_sync`). Raises
    RuntimeError as `shard_model` (`device`, `precision` too)."""
    blocks = getattr(stage.encoder, "blocks", ())
    units = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
    units += [getattr(stage, p) for p in stage.projector_names]
    _shard(stage, units, group, stage.name, reshard_root=True, device=device, precision=precision)


def _shard(root, units: list, group, name: str, reshard_root: bool | None = None,
           device=None, precision: Precision | str = "fp32") -> None:
    """`fully_shard` each of `units`, then `root` (the rest of its parameters), over `group`:
    gradients summed (divide factor 1), unused parameters reduce-scattered as zeros, and the
    TP `shard_spec` of every parameter carried over to its DTensor. `reshard_root`: FSDP's
    `reshard_after_forward` of the root (None: torch's default, kept whole after forward).
    `precision`: the run's; units gather in its compute dtype (`Precision.fsdp_policy`)."""
    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        raise RuntimeError(f"{name}.layout.dp_shard=true needs "
                           f"FSDPModule.set_reduce_scatter_unused_params, which torch "
                           f"{torch.__version__} lacks: upgrade torch (2.13 has it) or set "
                           f"{name}.layout.dp_shard=false")
    specs = {n: p.shard_spec for n, p in root.named_parameters() if getattr(p, "shard_spec", None)}
    kind = torch.device(device).type if device is not None else next(root.parameters()).device.type
    mesh = DeviceMesh.from_group(group, device_type=kind)
    policy = Precision.of(precision)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy.fsdp_policy(root=False))
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard_root,
                mp_policy=policy.fsdp_policy(root=True))
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            module.set_reduce_scatter_unused_params(True)
    for n, p in root.named_parameters():
        if n in specs:
            p.shard_spec = specs[n]
