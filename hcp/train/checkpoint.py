"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, resumable, pruned.

Layout of `checkpoint.dir`: one folder per saved step, `step_00000100/`, holding the DCP shards
of the model and optimizer state, `trainer.json` (step, scheduler and data-loader position,
the layout it was saved at and the FQNs it trained; written by rank 0) and `rng_rank{r}.pt`
(each rank's RNG states; restored only under the same layout). A save goes to
`.tmp-step_XXXXXXXX/` and is renamed into place by rank 0 only after every rank finished
writing, so a crash mid-save never leaves a step folder that cannot load. Only complete
folders count for `resume=auto`; the oldest are pruned down to `checkpoint.keep`. State is saved
and loaded sharded as training holds it (`_state`: nothing gathered, so a save or a resume needs
no more device memory than training); `checkpoint.async` writes in the background
(`hcp.train.async_checkpoint`). docs/checkpoints.md.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import zlib
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hcp.config.errors import ConfigError
from hcp.config.settings import CheckpointSpec

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _options() -> StateDictOptions:
    """Sharded state keyed per parameter FQN: optimizer state as `state.{fqn}.exp_avg` and
    `param_groups.{fqn}.lr` (pipeline stages hold different parameters, so positional
    param_groups would collide in DCP); FSDP's DTensors as they are, nothing gathered, so a save
    or a resume holds no tensor that training does not hold already."""
    return StateDictOptions(flatten_optimizer_state_dict=True)


def step_dirs(root: str) -> list[tuple[int, str]]:
    """Complete checkpoint folders under `root` as (step, path), oldest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name))
             for name in os.listdir(root) if (m := _STEP_DIR.match(name))]
    return sorted(found)


def latest(root: str) -> Optional[str]:
    """Path of the newest complete checkpoint under `root`, or None."""
    dirs = step_dirs(root)
    return dirs[-1][1] if dirs else None


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _tp_groups(tp_group) -> list:
    """The distinct TP groups of `tp_group`: one group, or {module: group or None} when modules
    have their own TP groups (heterogeneous layouts; module = first part of the FQN)."""
    groups = tp_group.values() if isinstance(tp_group, dict) else [tp_group]
    return list({id(g): g for g in groups if g is not None}.values())


def _tp_group_of(tp_group, fqn: str):
    return tp_group.get(fqn.split(".")[0]) if isinstance(tp_group, dict) else tp_group


def _tp_wrapper(model, tp_group):
    """(FQN -> ShardSpec of TP-sharded parameters, wrap(tensor, spec, fqn) -> DTensor of the
    whole parameter's shape). A plain tensor (this rank's TP slice) becomes a DTensor over the
    parameter's TP group; an FSDP shard of the TP slice (a DTensor over its DP x CP mesh)
    becomes one over the 2-D mesh (DP x CP, TP), so DCP writes and reads each rank's own rows
    at their offset in the whole tensor and reshards across layouts by itself."""
    specs = {n: p.shard_spec for n, p in model.named_parameters() if getattr(p, "shard_spec", None)}
    device = next(model.parameters()).device.type
    tp_meshes = {id(g): DeviceMesh.from_group(g, device_type=device) for g in _tp_groups(tp_group)}
    meshes = {}

    def wrap(t, spec, fqn):
        group = _tp_group_of(tp_group, fqn)
        shape = tuple(spec.whole_shape(t.shape))
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))  # contiguous
        if not isinstance(t, DTensor):
            return DTensor.from_local(t, tp_meshes[id(group)], [Shard(spec.dim)], run_check=False,
                                      shape=shape, stride=stride)
        key = (id(t.device_mesh), id(group))
        if key not in meshes:
            meshes[key] = _dp_tp_mesh(t.device_mesh, group, device)
        fsdp, = t.placements  # Shard(k) over DP x CP of the TP slice
        tp = dist.get_world_size(group)
        outer = _StridedShard(fsdp.dim, split_factor=tp) if fsdp.dim == spec.dim else fsdp
        return DTensor.from_local(t.to_local(), meshes[key], [outer, Shard(spec.dim)],
                                  run_check=False, shape=shape, stride=stride)
    return specs, wrap


def _dp_tp_mesh(dp_mesh: DeviceMesh, tp_group, device: str) -> DeviceMesh:
    """The 2-D mesh [DP x CP, TP] of an FSDP mesh and a TP group: a module's grid of ranks is a
    box (`hcp.parallel.grid`), so the TP group of the rank at DP x CP index i is this rank's TP
    group moved by that rank's distance from this one. The same placements as torch's FSDP2 over
    a TP DTensor (`_fsdp_param.py`: `_StridedShard` when both shard the same dim)."""
    me, tp_ranks = dist.get_rank(), dist.get_process_group_ranks(tp_group)
    dp_ranks = dist.get_process_group_ranks(dp_mesh.get_group())
    grid = [[d + t - me for t in tp_ranks] for d in dp_ranks]
    return DeviceMesh.from_group([dp_mesh.get_group(), tp_group], device, mesh=grid,
                                 mesh_dim_names=("dp_cp", "tp"))


def _state(model, optimizer, tp_group) -> tuple[dict, dict]:
    """Model and optimizer state keyed by FQN, sharded as training holds it, and {id(wrapper):
    the tensor it wraps} for `_local`. TP-sharded parameters (those with a `shard_spec`) and
    their Adam moments become DTensors of the whole parameter (`_tp_wrapper`), so DCP stores each
    shard once with its offset (replicas over DP/CP are deduplicated) and can load it into
    another TP, DP or FSDP layout. Every stage of a pipeline saves its own FQNs."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    if tp_group is None:
        return {"model": model_sd, "optim": optim_sd}, {}
    specs, wrap = _tp_wrapper(model, tp_group)
    wrapped = {}

    def wrapper(t, name):
        w = wrap(t, specs[name], name)
        wrapped[id(w)] = t
        return w
    shapes = {n: _local_shape(t) for n, t in model_sd.items() if n in specs}
    for name in shapes:
        model_sd[name] = wrapper(model_sd[name], name)
    for key, t in optim_sd.items():
        name = key.removeprefix("state.").rpartition(".")[0]
        moment = torch.is_tensor(t) and name in shapes and _local_shape(t) == shapes[name]
        if key.startswith("state.") and moment:
            optim_sd[key] = wrapper(t, name)
    return {"model": model_sd, "optim": optim_sd}, wrapped


def _local_shape(t: torch.Tensor) -> torch.Size:
    return t.to_local().shape if isinstance(t, DTensor) else t.shape


def _model_state(model, tp_group) -> tuple[dict, dict]:
    """The model half of `_state` (the same DCP keys), without an optimizer."""
    model_sd = get_model_state_dict(model, options=_options())
    wrapped = {}
    if tp_group is not None:
        specs, wrap = _tp_wrapper(model, tp_group)
        for n in [n for n in model_sd if n in specs]:
            t = model_sd[n]
            model_sd[n] = wrap(t, specs[n], n)
            wrapped[id(model_sd[n])] = t
    return {"model": model_sd}, wrapped


def _local(tree, wrapped: dict):
    """The same nested dict with every TP wrapper of `_state` (a DTensor of the whole
    parameter, loaded in place) replaced by the tensor it wraps: this rank's TP slice, or FSDP's
    own DTensor of it."""
    if isinstance(tree, dict):
        return {k: _local(v, wrapped) for k, v in tree.items()}
    return wrapped.get(id(tree), tree)


def save(root: str, step: int, model, optimizer, trainer_state: dict, keep: int,
         tp_group=None, writer=None) -> str:
    """Save on every rank (a collective); returns the final folder path.

    `trainer_state` is JSON-serializable (scheduler state, data position, step); `tp_group` is
    the model's TP group (None when tp = 1), or {module: its TP group or None} when modules have
    their own. `writer` (`hcp.train.async_checkpoint.AsyncWriter`, `checkpoint.async=true`):
    the shards are staged to host memory and written in the background, and the folder is renamed
    into place when every rank's write finished; None: written and renamed before returning.
    """
    rank = dist.get_rank()
    trainable = [None] * dist.get_world_size()
    dist.all_gather_object(trainable, [n for n, p in model.named_parameters() if p.requires_grad])
    trainer_state = {**trainer_state, "layout": layout_label(model, tp_group),
                     "trainable": sorted(set().union(*trainable))}
    final = os.path.join(root, f"step_{step:08d}")
    tmp = os.path.join(root, f".tmp-step_{step:08d}")
    if writer is not None:
        writer.wait()  # the previous save is published (or raises) before this one starts
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(tmp, "trainer.json"), "w") as f:
            json.dump(trainer_state, f)
    state = _state(model, optimizer, tp_group)[0]
    if writer is not None:
        writer.submit(state, tmp, (lambda: _publish(root, tmp, final, keep)) if rank == 0 else None)
        return final
    dcp.save(state, checkpoint_id=tmp)
    dist.barrier()
    if rank == 0:
        _publish(root, tmp, final, keep)
    dist.barrier()
    return final


def _publish(root: str, tmp: str, final: str, keep: int) -> None:
    """Rank 0, once every rank's shards are written: the `.tmp-` folder becomes `final` (the
    step counts for `resume=auto` from here on), and the oldest are pruned down to `keep`."""
    _remove(final)
    os.rename(tmp, final)
    for _, old in step_dirs(root)[:-keep] if keep > 0 else []:
        _remove(old)


def _remove(path: str) -> None:
    """Delete a checkpoint folder so that it stops counting at once: renamed out of the
    `step_XXXXXXXX` pattern first, then deleted (a crash mid-delete leaves only a `.trash-`
    folder)."""
    if os.path.isdir(path):
        trash = os.path.join(os.path.dirname(path), ".trash-" + os.path.basename(path))
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def layout_label(model, tp_group) -> str:
    """This run's LLM layout as users write it, e.g. `dp4`, `tp2 x dp2`, `pp2 x dp2 (dp_shard)`
    (`(dp_shard)`: the LLM's own parameters are FSDP shards; the encoder side's do not count);
    a model that names its run's layout itself (`layout_label`, e.g. the islands of
    `hcp.train.islands.IslandModules`) gives the same label on every rank."""
    if isinstance(getattr(model, "layout_label", None), str):
        return model.layout_label
    tp = _size(tp_group.get("llm") if isinstance(tp_group, dict) else tp_group)
    cp = _size(getattr(model, "cp_group", None))
    pp = model.stage.num_stages if hasattr(model, "stage") else 1
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dist.get_world_size() // (tp * cp * pp)}
    label = " x ".join(f"{k}{v}" for k, v in sizes.items() if v > 1) or "1 rank"
    llm_sharded = any(isinstance(p, DTensor)
                      for n, p in model.named_parameters() if n.startswith("llm."))
    return label + (" (dp_shard)" if llm_sharded else "")


def layouts_label(layouts: dict) -> str:
    """A colocated heterogeneous run's layout as users write it, every module named, e.g.
    `llm tp2 x cp2 | vision dp4 (dp_shard) | projector dp4`: a resume under another encoder
    layout says so (and derives the per-rank RNG streams) as it does for the LLM's.
    `layouts`: module -> `hcp.config.layouts.ResolvedLayout`."""
    def one(m, lay):
        sizes = " x ".join(f"{k}{getattr(lay, k)}" for k in ("tp", "cp", "pp", "dp")
                           if getattr(lay, k) > 1)
        return f"{m} {sizes or '1 rank'}" + (" (dp_shard)" if lay.dp_shard else "")
    return " | ".join(one(m, layouts[m])
                      for m in ["llm", *sorted(m for m in layouts if m != "llm")])


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _trainer_json(path: str) -> dict:
    with open(os.path.join(path, "trainer.json")) as f:
        return json.load(f)


def _check_folder(key: str, path) -> None:
    if (path is None or (path == "auto" and key == "resume")
        or os.path.isfile(os.path.join(path, "trainer.json"))):
        return
    raise ConfigError(key, path, "not a complete checkpoint folder (trainer.json and DCP shards)",
                      "use resume=auto with checkpoint.dir=DIR, or a step_XXXXXXXX folder")


def expected_trainable(specs) -> set[str]:
    """FQNs the run of `specs` (`hcp.config.specs.ModuleSpecs`) trains (the whole model, every
    stage; built on the meta device)."""
    from hcp.model.encoder_side import llava_kwargs
    from hcp.model.llava import LlavaModel

    with torch.device("meta"):  # named encoders and projectors too (h-encoders)
        model = LlavaModel(**llava_kwargs(specs))
    return {n for n, _ in model.named_parameters()
            if n.split(".")[0] in specs and not specs[n.split(".")[0]].freeze}


def check_resume(ck: CheckpointSpec, specs, max_steps: int, weights_only: bool = False) -> None:
    """Before ranks start: `ck.resume` and `ck.init_from_checkpoint` must be None, (`auto`,) or
    complete checkpoint folders, and the checkpoint `resume` continues must have trained the same
    parameters this config trains (else it is a new stage: `init_from_checkpoint`) and be at most
    at `max_steps` (`trainer.max_steps`). `specs`: the config's `hcp.config.specs.ModuleSpecs`;
    `weights_only` (mode=export) checks the folders only: an export reads the weights, whatever
    trained them.

    Raises:
        ConfigError: a folder that is not a complete checkpoint; a checkpoint past
            `trainer.max_steps`; trainable parameters that differ
            (names the parameters on each side: frozen now, absent now (modules this config
            lacks) or trained now, and the key to use instead).
    """
    _check_folder("resume", ck.resume)
    _check_folder("init_from_checkpoint", ck.init_from_checkpoint)
    path = start_path(ck)
    if path is None or weights_only:
        return
    state = _trainer_json(path)
    step = state.get("step", 0)
    if step > max_steps:  # equal: a finished run requeued, nothing left to do
        raise ConfigError("trainer.max_steps", max_steps, f"{path} is already at step "
                          f"{step}, past the last step", f"to continue it, use trainer.max_steps > "
                          f"{step}; to start a new stage from its weights, use "
                          f"init_from_checkpoint={path} instead of resume")
    saved = state.get("trainable")
    if saved is None:
        return
    now, present = expected_trainable(specs), set(specs.names)
    gone, new = sorted(set(saved) - now), sorted(now - set(saved))
    if gone or new:
        absent = [n for n in gone if n.split(".")[0] not in present]  # modules this config lacks
        frozen = [n for n in gone if n.split(".")[0] in present]
        what = "; ".join(f"{label} ({len(v)}): {', '.join(v[:6])}{', ...' if len(v) > 6 else ''}"
                         for label, v in (("trained there, frozen now", frozen),
                                          ("trained there, absent now", absent),
                                          ("frozen there, trained now", new)) if v)
        raise ConfigError("resume", ck.resume, f"{path} trained other parameters than this config "
                          f"does ({what}), so it is not the same run", f"to start a new stage from "
                          f"its weights (fresh optimizer and schedule), use "
                          f"init_from_checkpoint={path} instead of resume")


def load_weights(path: str, model, tp_group=None) -> str:
    """Model weights only from a checkpoint folder into `model` (any layout; every rank), for a
    new stage (`init_from_checkpoint`) or an export. Returns what was loaded, for a log line:
    `model weights of step N from PATH (saved at LAYOUT)`.

    Raises:
        FileNotFoundError: `path` is not a complete checkpoint folder.
    """
    if not os.path.isfile(os.path.join(path, "trainer.json")):
        raise FileNotFoundError(f"init_from_checkpoint={path!r}: not a complete checkpoint folder")
    state, wrapped = _model_state(model, tp_group)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, _local(state, wrapped)["model"], options=_options())
    saved = _trainer_json(path)
    return (f"model weights of step {saved['step']} from {path} (saved at "
            f"{saved.get('layout', '?')})")


def load(path: str, model, optimizer, tp_group=None) -> dict:
    """Load a checkpoint folder into `model` and `optimizer` (every rank); return trainer state
    with `note`: the log line, saying when the layout differs from the checkpoint's and that the
    per-rank RNG streams were then derived from (seed, step, rank) instead of restored.

    Raises:
        FileNotFoundError: `path` is not a complete checkpoint folder.
    """
    if not os.path.isfile(os.path.join(path, "trainer.json")):
        raise FileNotFoundError(f"resume={path!r}: not a complete checkpoint folder "
                                "(expected trainer.json and DCP shards)")
    state, wrapped = _state(model, optimizer, tp_group)
    dcp.load(state, checkpoint_id=path)
    state = _local(state, wrapped)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=_options())
    saved = _trainer_json(path)
    now, then = layout_label(model, tp_group), saved.get("layout", "?")
    rank, step = dist.get_rank(), saved["step"]
    rng_file = os.path.join(path, f"rng_rank{rank}.pt")
    if now == then and os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
        saved["note"] = f"resumed from step {step} saved at {then} ({path})"
    else:
        seed = derived_seed(torch.initial_seed(), step, rank)
        torch.manual_seed(seed)
        random.seed(seed)
        saved["note"] = (f"resumed from step {step} saved at {then}, now {now} ({path}); per-rank "
                         "RNG streams do not carry over to another layout: derived from (seed, "
                         "step, rank)")
    return saved


def derived_seed(seed: int, step: int, rank: int) -> int:
    """A rank's RNG seed after a resume under another layout (stable across processes)."""
    return zlib.crc32(f"{seed}:{step}:{rank}".encode())


def start_path(ck: CheckpointSpec) -> str | None:
    """The checkpoint folder a run of `ck` continues: the latest in `ck.dir` under `resume=auto`
    (None when there is none yet), else `ck.resume` (None: a fresh run)."""
    return latest(ck.dir) if ck.resume == "auto" else ck.resume


def resume(ck: CheckpointSpec, modules, optimizer, scheduler, sampler,
           tp_groups) -> tuple[int, str | None]:
    """Start of a run as `ck.resume` / `ck.init_from_checkpoint` say: load the latest (or
    the named) checkpoint into `modules`, `optimizer`, `scheduler` and `sampler`, or only the
    weights of `init_from_checkpoint` (a new stage). Returns (the step to start at, a note for
    the log or None). Every rank calls it (a collective load)."""
    path = start_path(ck)
    if path is None and ck.init_from_checkpoint:  # a new stage: weights only
        loaded = load_weights(ck.init_from_checkpoint, modules, tp_groups)
        return (0,
                f"init_from_checkpoint: {loaded}; optimizer, schedule and data start fresh at step "
                f"0")
    if not ck.resume:
        return 0, None
    if path is None:  # resume=auto with no checkpoint yet: a fresh start, said so
        return 0, f"resume=auto: no checkpoint in checkpoint.dir={ck.dir}; starting at step 0"
    state = load(path, modules, optimizer, tp_groups)
    scheduler.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["sampler"])
    note = state["note"]
    if scheduler.change_note:  # a changed trainer.max_steps / optim.lr: said, and followed
        note += "\n" + scheduler.change_note
    return state["step"], note
