"""Hugging Face CLIP vision tower (CLIPVisionModel, or the vision half of a CLIPModel such as
openai/clip-vit-large-patch14-336) <-> hcp's `vision` module with `vision.arch=clip`.

Names (ours under `vision.` -> transformers', after an optional `vision_model.` prefix):
    patch_embed.weight [D, C*p*p]   embeddings.patch_embedding.weight [D, C, p, p] (conv, no bias)
    class_embedding                 embeddings.class_embedding
    position_embedding [P + 1, D]   embeddings.position_embedding.weight
    pre_norm.{weight,bias}          pre_layrnorm.{weight,bias} (sic)
    blocks.{i}.ln1 / ln2            encoder.layers.{i}.layer_norm1 / layer_norm2
    blocks.{i}.{q,k,v}_proj         encoder.layers.{i}.self_attn.{q,k,v}_proj
    blocks.{i}.o_proj               encoder.layers.{i}.self_attn.out_proj
    blocks.{i}.fc1 / fc2            encoder.layers.{i}.mlp.fc1 / fc2
Not loaded by design (listed in the log): blocks after `select_layer` and `post_layernorm`
(LLaVA reads the hidden state of `select_layer`, before them), and a CLIPModel's text tower and
projections.
"""
from __future__ import annotations

from hcp.config.errors import ConfigError
from hcp.model.hf_io import HFCheckpoint, Source

PREFIX = "vision_model."
_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
             "num_attention_heads": 12, "image_size": 224, "patch_size": 32, "num_channels": 3,
             "layer_norm_eps": 1e-5, "hidden_act": "quick_gelu"}
_ACTS = {"quick_gelu": "clip", "gelu": "vit"}


def _vision_json(hf: dict) -> dict:
    """The vision tower's config: a CLIPModel nests it under `vision_config`."""
    return {**_DEFAULTS, **(hf.get("vision_config") or {})} if hf.get("model_type") == "clip" \
        else {**_DEFAULTS, **hf}


def config_fields(hf: dict, field: str = "vision.init_from") -> dict:
    """`vision.*` values from a CLIP config.json (CLIPVisionModel or CLIPModel).

    Raises:
        ConfigError: not a CLIP checkpoint, or an activation hcp's ViT does not implement.
    """
    if hf.get("model_type") not in ("clip", "clip_vision_model"):
        raise ConfigError(field, hf.get("model_type"), "config.json's model_type is not `clip` or "
                          "`clip_vision_model`", "point vision.init_from to a CLIP checkpoint")
    v = _vision_json(hf)
    if v["hidden_act"] not in _ACTS:
        raise ConfigError(field, v["hidden_act"], "config.json's hidden_act is not implemented by "
                          "hcp's ViT", "use a CLIP checkpoint with quick_gelu or gelu")
    return {"image_size": v["image_size"], "patch_size": v["patch_size"],
            "num_channels": v["num_channels"], "hidden_size": v["hidden_size"],
            "num_layers": v["num_hidden_layers"], "num_heads": v["num_attention_heads"],
            "ffn_hidden_size": v["intermediate_size"], "norm_eps": float(v["layer_norm_eps"]),
            "arch": _ACTS[v["hidden_act"]]}


def hf_config(vision, dtype: str) -> dict:
    """config.json of a CLIPVisionModel with `vision`'s architecture, stored in `dtype`."""
    act = {v: k for k, v in _ACTS.items()}[vision.arch]
    return {"architectures": ["CLIPVisionModel"], "model_type": "clip_vision_model",
            "hidden_size": vision.hidden_size, "intermediate_size": vision.ffn_hidden_size,
            "num_hidden_layers": vision.num_layers, "num_attention_heads": vision.num_heads,
            "image_size": vision.image_size, "patch_size": vision.patch_size,
            "num_channels": vision.num_channels, "layer_norm_eps": vision.norm_eps,
            "hidden_act": act, "torch_dtype": dtype, "dtype": dtype}


def used_blocks(vision) -> int:
    """Blocks that feed `select_layer` (the ones hcp builds)."""
    return vision.num_layers + vision.select_layer + 1


_BLOCK = {**{f"{p}.{w}": f"{q}.{w}" for p, q in (
    ("ln1", "layer_norm1"), ("ln2", "layer_norm2"), ("q_proj", "self_attn.q_proj"),
    ("k_proj", "self_attn.k_proj"), ("v_proj", "self_attn.v_proj"),
    ("o_proj", "self_attn.out_proj"), ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2"))
    for w in ("weight", "bias")}}


def hf_names(vision, prefix: str = PREFIX) -> dict[str, str]:
    """Every `vision` parameter -> its transformers key (with `prefix`)."""
    names = {"class_embedding": "embeddings.class_embedding",
             "position_embedding": "embeddings.position_embedding.weight",
             "patch_embed.weight": "embeddings.patch_embedding.weight",
             "pre_norm.weight": "pre_layrnorm.weight", "pre_norm.bias": "pre_layrnorm.bias"}
    for i in range(used_blocks(vision)):
        names.update({f"blocks.{i}.{o}": f"encoder.layers.{i}.{t}" for o, t in _BLOCK.items()})
    return {o: prefix + t for o, t in names.items()}


def prefix_of(keys) -> str:
    """`vision_model.` when the checkpoint's keys carry it (transformers 4.x, CLIPModel), else
    ``."""
    return PREFIX if any(k.startswith(PREFIX) for k in keys) else ""


def sources(vision, ckpt: HFCheckpoint) -> dict[str, Source]:
    """Where each `vision` parameter is in `ckpt` (the conv patch weight read as our linear)."""
    d, patch = vision.hidden_size, vision.num_channels * vision.patch_size ** 2
    return {o: Source(k, shape=(d, patch) if o == "patch_embed.weight" else None)
            for o, k in hf_names(vision, prefix_of(ckpt.files)).items()}


def ignored(vision, keys) -> dict[str, str]:
    """Tensors of a CLIP checkpoint not loaded by design: {key: why}."""
    p, n = prefix_of(keys), used_blocks(vision)
    out = {}
    for k in keys:
        rest = k[len(p):] if k.startswith(p) else None
        if (rest is None or k.startswith(("text_model.", "text_projection", "visual_projection",
                                          "logit_scale"))):
            out[k] = "CLIP text side"
        elif rest.startswith("post_layernorm."):
            out[k] = "after select_layer"
        elif rest.startswith("encoder.layers.") and int(rest.split(".")[2]) >= n:
            out[k] = "after select_layer"
        elif rest == "embeddings.position_ids":
            out[k] = "recomputed"
    return out
