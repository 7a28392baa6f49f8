"""`mode=export export.dir=OUT`: the model as the run would start it (random init, `init_from`,
`init_from_checkpoint` or the checkpoint `resume` names) written as Hugging Face checkpoints:

    OUT/llm/              LlamaForCausalLM (config.json, safetensors; one shard per pipeline stage
                          with model.safetensors.index.json when pp > 1)
    OUT/vision/           CLIPVisionModel (`vision_model.` names, transformers 4.x and 5.x load it)
    OUT/mm_projector.bin  the projector in LLaVA-1.5's names (`model.mm_projector.0.weight`, ...
                          for mlp2x_gelu, `model.mm_projector.weight` for linear), as LLaVA's
                          `--pretrain_mm_mlp_adapter` reads it

Every rank of the layout builds its part of the model; FSDP shards are gathered over DP x CP and
TP slices over TP (collectives in parameter order, the same on every rank of a stage); the
first DP x CP x TP rank of each pipeline stage writes that stage's shard and rank 0 the index and
configs. Tensors a vision checkpoint holds that the model does not (blocks after `select_layer`,
`post_layernorm`) are copied through from `vision.init_from` unchanged.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hcp.config.schema import ExportConfig
from hcp.config.specs import ModuleSpec, ModuleSpecs
from hcp.model import hf_clip, hf_llama
from hcp.model.hf_io import DTYPES, INDEX, HFCheckpoint, Source, write_folder

PROJECTOR_NAMES = {"fc1": "model.mm_projector.0", "fc2": "model.mm_projector.2",
                   "fc": "model.mm_projector"}
"""Our projector submodules -> LLaVA-1.5's names (nn.Sequential(Linear, GELU, Linear))."""


def _whole(param, tp_group) -> torch.Tensor:
    """The unsharded tensor of a parameter: FSDP shards gathered, then TP slices (collectives)."""
    t = param.full_tensor() if isinstance(param, DTensor) else param.detach()
    spec = getattr(param, "shard_spec", None)
    if spec is None or spec.world == 1:
        return t
    if tp_group is None:
        raise ValueError("export: a TP-sharded parameter whose module names no TP group")
    parts = [torch.empty_like(t) for _ in range(spec.world)]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    return torch.cat(parts, dim=spec.dim)


def _dtype(export_cfg: ExportConfig, spec: ModuleSpec) -> torch.dtype:
    """The dtype `spec`'s tensors are written in (`export.dtype`; `auto`: its `init_from`'s)."""
    name = export_cfg.dtype
    if name == "auto":
        name = HFCheckpoint(spec.init_from).dtype() if spec.init_from else "float32"
    return DTYPES[name]


def module_tensors(model, spec: ModuleSpec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This stage's whole tensors of module `spec` (`llm` or `vision`) under their transformers
    names, in `dtype` (a collective over the module's TP and DP x CP groups)."""
    module = getattr(model, spec.name, None)
    if module is None:
        return {}
    arch = spec.arch
    names = hf_llama.hf_names(arch) if spec.kind == "llm" else hf_clip.hf_names(arch)
    tp_group = getattr(module, "tp_group", None)
    out = {}
    for name, p in module.named_parameters():
        t = _whole(p, tp_group).to("cpu", dtype)
        out[names[name]] = t.reshape(t.shape[0], arch.num_channels, arch.patch_size,
                                     arch.patch_size) if name == "patch_embed.weight" else t
    return out


def projector_tensors(model) -> dict[str, torch.Tensor]:
    """The projector's tensors in LLaVA-1.5's names (first stage only; replicated, no
    collective)."""
    if getattr(model, "projector", None) is None:
        return {}
    return {f"{PROJECTOR_NAMES[n.split('.')[0]]}.{n.split('.')[1]}":
            p.detach().cpu().float().clone()
            for n, p in model.projector.named_parameters()}


def _vision_passthrough(vision: ModuleSpec) -> tuple[dict[str, torch.Tensor], int]:
    """Tensors of `vision.init_from` the model does not hold (after select_layer), and the
    checkpoint's block count; ({}, built blocks) without init_from."""
    if not vision.init_from:
        return {}, hf_clip.used_blocks(vision.arch)
    ckpt = HFCheckpoint(vision.init_from)
    p = hf_clip.prefix_of(ckpt.files)
    keep = [k for k, why in hf_clip.ignored(vision.arch, ckpt.keys()).items()
            if why == "after select_layer"]
    return ({hf_clip.PREFIX + k[len(p):]: ckpt.read(Source(k)) for k in keep},
            vision.arch.num_layers)


def export(model, specs: ModuleSpecs, export_cfg: ExportConfig, stage, writer: bool) -> list[str]:
    """Write `export_cfg.dir` (see the module docstring) from every rank's part of `model`, a run
    of `specs` (vision -> projector -> llm). `stage` is this rank's `StageSpec`; `writer` is True
    on one rank per pipeline stage. Returns the files written (on rank 0: all of them)."""
    out = export_cfg.dir
    dtypes = {m.name: _dtype(export_cfg, m) for m in specs if m.name in ("llm", "vision")}
    llm = module_tensors(model, specs.llm, dtypes["llm"])
    vision = module_tensors(model, specs["vision"], dtypes["vision"]) if "vision" in specs else {}
    name = (f"model-{stage.index + 1:05d}-of-{stage.num_stages:05d}.safetensors"
            if stage.num_stages > 1 else "model.safetensors")
    if writer:
        write_folder(os.path.join(out, "llm"), name, llm, hf_llama.hf_config(specs.llm.arch, str(
            dtypes["llm"]).removeprefix("torch.")))
        if stage.first and vision:
            extra, layers = _vision_passthrough(specs["vision"])
            vcfg = hf_clip.hf_config(specs["vision"].arch,
                                     str(dtypes["vision"]).removeprefix("torch."))
            vcfg["num_hidden_layers"] = layers
            write_folder(os.path.join(out, "vision"), "model.safetensors", {
                **vision, **{k: t.to(dtypes["vision"]) for k, t in extra.items()}}, vcfg)
        if stage.first and getattr(model, "projector", None) is not None:
            torch.save(projector_tensors(model), os.path.join(out, "mm_projector.bin"))
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (name, sorted(llm),
                                    sum(t.numel() * t.element_size() for t in llm.values()))
                           if writer else None)
    files = sorted({s[0] for s in shards if s})
    if dist.get_rank() == 0 and len(files) > 1:
        index = {"metadata": {"total_size": sum(s[2]
                                                for s in {s[0]: s for s in shards if s}.values())},
                 "weight_map": {k: s[0] for s in shards if s for k in s[1]}}
        with open(os.path.join(out, "llm", INDEX), "w") as f:
            json.dump(index, f, indent=2)
    dist.barrier()
    return [os.path.join(out, "llm", f) for f in files]


def start_export(cfg, specs, run_dir: str, joined, world: int) -> None:
    """`mode=export` in the launching process: check `export.dir` and the graph (`specs`:
    `hcp.config.specs.ModuleSpecs`), then run `run_export_rank` on this launch's ranks (joined,
    or started locally like training's).

    Raises:
        ConfigError: no `export.dir`; named encoders or projectors (Hugging Face's LLaVA has one
            vision tower and one projector: they would be left out).
    """
    from omegaconf import OmegaConf

    from hcp.config.errors import ConfigError
    from hcp.launch.launch import export_rank_env, local_start_method, start_local_ranks

    if not cfg.export.dir:
        raise ConfigError("export.dir", cfg.export.dir, "mode=export needs a folder to write",
                          "add export.dir=OUT")
    if specs.several_streams:
        raise ConfigError("graph.edges", [list(e) for e in cfg.graph.edges], "mode=export writes "
                          "Hugging Face's LLaVA (one vision tower, one projector); the named "
                          "encoders and projectors would be left out", "export a config with "
                          "vision -> projector -> llm only")
    payload = (OmegaConf.to_container(cfg, resolve=True), run_dir)
    if joined:
        export_rank_env(joined)
        _export_entry(payload)
    else:
        start_local_ranks(_export_entry, world, payload, local_start_method(cfg.launcher))


def _export_entry(payload) -> None:
    from omegaconf import OmegaConf

    container, run_dir = payload
    run_export_rank(OmegaConf.create(container), run_dir)


def run_export_rank(cfg, run_dir: str) -> None:
    """One rank of `mode=export`: build this rank's part of the model as training would start
    it (init, `init_from`, then the weights of `init_from_checkpoint` or of the checkpoint
    `resume` names), then `export`."""
    from hcp.config.layouts import resolve_layouts
    from hcp.config.settings import CheckpointSpec
    from hcp.config.specs import resolve_modules, typed
    from hcp.model import LlavaModel, init_parameters
    from hcp.model.encoder_side import llava_kwargs
    from hcp.model.hf_load import load_pretrained, loaded_modules
    from hcp.model.stage import StageSpec
    from hcp.parallel.groups import ProcessGroupRegistry
    from hcp.train import checkpoint
    from hcp.launch.distributed import init_distributed

    device = init_distributed(cfg.launcher)
    try:
        rank = dist.get_rank()
        layouts = resolve_layouts(cfg, dist.get_world_size())
        specs, export_cfg = resolve_modules(cfg, layouts), typed(cfg.export, ExportConfig)
        llm, groups = layouts["llm"], ProcessGroupRegistry(layouts)
        coords = groups.grids["llm"].coords(rank)
        stage = StageSpec.of(llm.pp_layers, coords["pp"])
        tp_group = groups.group("llm", "tp") if llm.tp > 1 else None
        model = LlavaModel(**llava_kwargs(specs), tp_group=tp_group, stage=stage,
                           cp_group=groups.group("llm", "cp") if llm.cp > 1 else None)
        loaded = {id(p) for m in loaded_modules(cfg) for p in getattr(model, m).parameters()}
        init_parameters(model, cfg.seed, skip=loaded)  # init_from's weights: never drawn
        load_pretrained(model, cfg)
        model.to(device)
        ck = CheckpointSpec.of(cfg)
        path = checkpoint.start_path(ck) or ck.init_from_checkpoint
        source = (checkpoint.load_weights(path, model, tp_group) if path else
                  "the model as initialised"
                  + "".join(f" + {m}.init_from" for m in ("llm", "vision")
                                                        if m in specs and specs[m].init_from))
        writer = coords["tp"] == coords["cp"] == coords["dp"] == 0
        written = export(model, specs, export_cfg, stage, writer)
        if rank == 0:
            print(f"hcp: exported ({source}) to {export_cfg.dir}: {len(written)} LLM shard(s)"
                  + (", vision/, mm_projector.bin" if "vision" in specs else ""))
    finally:
        dist.destroy_process_group()
