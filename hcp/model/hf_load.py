"""`llm.init_from=DIR` / `vision.init_from=DIR`: Hugging Face weights into any layout.

Three steps, the first two in the launching process before any rank starts:
1. `apply_hf_configs(cfg, cli_keys)`: the module's architecture fields are replaced by those of
   the checkpoint's config.json; a value given on the command line that differs is an error
   naming both values.
2. `check_hf_weights(cfg)`: every parameter of the whole model (all pipeline stages) must find
   its tensor with its shape, and every tensor of the checkpoint must be used, or be one the
   format declares unused (a CLIP text tower, blocks after `select_layer`); mismatches and unused
   tensors are listed in one error. Only safetensors headers are read.
3. `load_pretrained(model, cfg)` on every rank, after `init_parameters`: each parameter reads
   only its own TP slice (its `shard_spec`) of its tensor, lazily, and keeps its FSDP shard of
   it (`hcp.model.init.local_box`); a pipeline stage reads only its own layers.
"""
from __future__ import annotations

import math

import torch

from hcp.config.errors import ConfigError
from hcp.model import hf_clip, hf_llama
from hcp.model.hf_io import HFCheckpoint, Source
from hcp.model.init import local_box

FORMATS = {"llm": hf_llama, "vision": hf_clip}
"""Module key -> its Hugging Face format (config_fields, sources, ignored)."""


def cli_keys(overrides) -> set[str]:
    """Dotted keys set on the command line (`llm.hidden_size=64`, `+x.y=1`) ->
    {`llm.hidden_size`}."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}


def apply_hf_configs(cfg, explicit: set[str]) -> list[str]:
    """Replace each `init_from` module's architecture fields by its config.json's, in place.
    Returns one line per module saying what was read.

    Raises:
        ConfigError: a command-line value conflicts with config.json (names both values), the
            checkpoint folder is missing or not a supported architecture.
    """
    lines = []
    for m, fmt in FORMATS.items():
        block = cfg.get(m)
        if block is None or not block.get("init_from"):
            continue
        ckpt = _open(cfg, m)
        fields = fmt.config_fields(ckpt.config, f"{m}.init_from")
        for key, value in fields.items():
            if f"{m}.{key}" in explicit and block[key] != value:
                raise ConfigError(f"{m}.{key}", block[key], f"conflicts with {key}={value!r} from "
                                  f"{m}.init_from={block.init_from}/config.json", f"drop {m}.{key} "
                                  "from the command line (the checkpoint defines it)")
            block[key] = value
        lines.append(f"{m}.init_from={block.init_from}: "
                     + ", ".join(f"{k}={v}" for k, v in fields.items()))
    return lines


def _open(cfg, m: str) -> HFCheckpoint:
    try:
        return HFCheckpoint(cfg[m].init_from, f"{m}.init_from")
    except FileNotFoundError as e:
        raise ConfigError(f"{m}.init_from", cfg[m].init_from, str(e).split(": ", 1)[-1],
                          "point it to a local Hugging Face checkpoint folder") from None


def whole_shapes(cfg, m: str) -> dict[str, tuple[int, ...]]:
    """Shapes of module `m`'s parameters in the whole, unsharded model (built on the meta
    device)."""
    from hcp.model.llama import LlamaDecoder
    from hcp.model.encoder_types import build_encoder

    with torch.device("meta"):
        module = LlamaDecoder(cfg.llm) if m == "llm" else build_encoder(cfg.vision)
    return {n: tuple(p.shape) for n, p in module.named_parameters()}


def _stored_shape(ckpt: HFCheckpoint, src: Source) -> tuple[int, ...]:
    shape = ckpt.shape(src.key)
    if src.shape is not None:
        return (tuple(src.shape)
                if math.prod(shape) == math.prod(src.shape) and shape[0] == src.shape[0] else shape)
    return (src.rows, *shape[1:]) if src.rows is not None else shape


def check_hf_weights(cfg) -> list[str]:
    """Check names and shapes of every `init_from` module (see the module docstring). Returns
    one line per module on what was not loaded by design.

    Raises:
        ConfigError: lists the parameters without a tensor, the shape mismatches and the
            unused tensors.
    """
    lines = []
    for m, fmt in FORMATS.items():
        if cfg.get(m) is None or not cfg[m].get("init_from"):
            continue
        ckpt = _open(cfg, m)
        srcs, shapes = fmt.sources(cfg[m], ckpt), whole_shapes(cfg, m)
        missing = [f"{m}.{n} <- {srcs[n].key}" for n in shapes if srcs[n].key not in ckpt.files]
        wrong = [f"{srcs[n].key}: stored {list(_stored_shape(ckpt, srcs[n]))}, {m}.{n} needs "
                 f"{list(s)}"
                 for n, s in shapes.items()
                 if srcs[n].key in ckpt.files and _stored_shape(ckpt, srcs[n]) != s]
        ends: dict[str, int] = {}
        for n in shapes:
            if srcs[n].rows is not None:
                ends[srcs[n].key] = max(ends.get(srcs[n].key, 0), srcs[n].row_start + srcs[n].rows)
        wrong += [f"{k}: stored {ckpt.shape(k)[0]} rows, its parts need {end}"
                  for k, end in ends.items() if k in ckpt.files and ckpt.shape(k)[0] != end]
        used = {srcs[n].key for n in shapes}
        ignored = fmt.ignored(cfg[m], ckpt.keys())
        unused = [k for k in ckpt.keys() if k not in used and k not in ignored]
        if missing or wrong or unused:
            parts = [f"{len(v)} {what}: {_few(v)}" for what, v in (
                ("parameters without a tensor", missing), ("shape mismatches", wrong),
                ("unused tensors", unused)) if v]
            raise ConfigError(f"{m}.init_from", cfg[m].init_from, "the checkpoint does not match "
                              f"the {m} module: " + "; ".join(parts), f"use a checkpoint of this "
                              f"architecture (its config.json sets {m}'s sizes)")
        if ignored:
            lines.append(f"{m}.init_from: not loaded by design ({len(ignored)} tensors): "
                         + _few(sorted(f"{k} ({why})" for k, why in ignored.items()), 6))
    return lines


def _few(items, n: int = 12) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


@torch.no_grad()
def load_module(module, ckpt: HFCheckpoint, srcs: dict[str, Source]) -> int:
    """Copy each parameter's slice of its tensor into `module` (any dtype -> the parameter's).
    Returns the number of bytes read.

    Raises:
        KeyError: a parameter has no source (check_hf_weights catches this before ranks start).
    """
    read = 0
    for name, param in module.named_parameters():
        spec = getattr(param, "shard_spec", None)
        tp_offset = [0] * param.dim()
        if spec is None:
            t = ckpt.read(srcs[name])
        else:
            size = param.shape[spec.dim]
            tp_offset[spec.dim] = spec.rank * size
            t = ckpt.read(srcs[name], spec.dim, spec.rank * size, size)
        if tuple(t.shape) != tuple(param.shape):
            raise ValueError(f"{srcs[name].key}: read {list(t.shape)} for {name} "
                             f"{list(param.shape)}")
        local, _, offset = local_box(param)  # an FSDP shard keeps its chunk of the TP slice
        local.copy_(t[tuple(slice(o - p, o - p + n)
                            for o, p, n in zip(offset, tp_offset, local.shape))])
        read += t.numel() * t.element_size()
    return read


def loaded_modules(cfg) -> tuple[str, ...]:
    """The modules whose every parameter `load_pretrained` overwrites (`<module>.init_from`;
    none when a checkpoint's weights replace them anyway): their random init is skipped
    (`hcp.model.init.materialize`'s `skip`)."""
    if cfg.get("init_from_checkpoint") or cfg.get("resume") not in (None, "auto"):
        return ()
    return tuple(m for m in FORMATS if cfg.get(m) is not None and cfg[m].get("init_from"))


def load_pretrained(model, cfg) -> dict[str, int]:
    """Overwrite every module of `model` (a LlavaModel, possibly one pipeline stage) whose
    config has `init_from` with the checkpoint's weights; returns {module: bytes read}. Nothing
    is read when a checkpoint's weights replace them anyway (`init_from_checkpoint`, or `resume`
    naming a folder): `init_from` then only sets the architecture."""
    read = {}
    for m in loaded_modules(cfg):
        module, fmt = getattr(model, m, None), FORMATS[m]
        if module is None:
            continue
        ckpt = HFCheckpoint(cfg[m].init_from, f"{m}.init_from")
        read[m] = load_module(module, ckpt, fmt.sources(cfg[m], ckpt))
    return read
