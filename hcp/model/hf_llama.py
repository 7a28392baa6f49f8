"""Hugging Face LLaMA (LlamaForCausalLM: LLaMA 1/2/3, Vicuna) <-> hcp's `llm` module.

Names (ours under `llm.` -> transformers'):
    embed_tokens.weight               model.embed_tokens.weight
    layers.{i}.attn_norm.weight       model.layers.{i}.input_layernorm.weight
    layers.{i}.attn.{q,k,v,o}_proj    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    layers.{i}.mlp_norm.weight        model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.{gate,up,down}_proj model.layers.{i}.mlp.{gate,up,down}_proj.weight
    norm.weight                       model.norm.weight
    lm_head.weight                    lm_head.weight (absent with tie_word_embeddings)
Checkpoints that fuse `self_attn.qkv_proj` ([q | k | v] rows, GQA: hq*D + 2*hkv*D) or
`mlp.gate_up_proj` ([gate | up]) are read by row ranges of the fused tensor. Both use the
"rotate half" RoPE of `hcp.model.layers.apply_rope` (transformers' conversion script already
permuted Meta's q/k), so no permutation is applied. Architecture fields come from config.json
(`config_fields`); features hcp's decoder does not have are errors naming the key.
"""
from __future__ import annotations

from hcp.config.errors import ConfigError
from hcp.model.hf_io import HFCheckpoint, Source

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Derived buffers some older checkpoints store: recomputed, never loaded (said in the log)."""


def config_fields(hf: dict, field: str = "llm.init_from") -> dict:
    """`llm.*` values from a LLaMA config.json.

    Raises:
        ConfigError: a model type or feature hcp's LLaMA decoder does not implement (biases,
            rope scaling, another activation, a head_dim other than hidden / heads).
    """
    if hf.get("model_type") != "llama":
        raise ConfigError(field, hf.get("model_type"), "config.json's model_type is not `llama`",
                          "point llm.init_from to a LlamaForCausalLM checkpoint (LLaMA, Vicuna)")
    rope = hf.get("rope_parameters") or {}
    scaling = (hf.get("rope_scaling")
               or ({} if rope.get("rope_type", "default") == "default" else rope))
    unsupported = {"hidden_act": hf.get("hidden_act", "silu") != "silu",
                   "attention_bias": bool(hf.get("attention_bias")),
                   "mlp_bias": bool(hf.get("mlp_bias")), "rope_scaling": bool(scaling)}
    for key, bad in unsupported.items():
        if bad:
            raise ConfigError(field, hf.get(key, scaling),
                              f"config.json sets {key}={hf.get(key, scaling)!r}, "
                              "which hcp's LLaMA decoder does not implement",
                              "use a plain LLaMA checkpoint (silu, no biases, no rope scaling)")
    heads = hf["num_attention_heads"]
    if hf.get("head_dim", hf["hidden_size"] // heads) * heads != hf["hidden_size"]:
        raise ConfigError(field, hf.get("head_dim"), "config.json's head_dim x num_attention_heads "
                          "is not hidden_size",
                          "use a checkpoint with head_dim = hidden_size / heads")
    return {"vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"],
            "num_layers": hf["num_hidden_layers"], "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "ffn_hidden_size": hf["intermediate_size"],
            "rope_theta": float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False))}


def hf_config(llm, dtype: str) -> dict:
    """config.json of a LlamaForCausalLM with `llm`'s architecture, stored in `dtype`."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": llm.vocab_size, "hidden_size": llm.hidden_size,
            "intermediate_size": llm.ffn_hidden_size, "num_hidden_layers": llm.num_layers,
            "num_attention_heads": llm.num_heads, "num_key_value_heads": llm.num_kv_heads,
            "head_dim": llm.hidden_size // llm.num_heads, "hidden_act": "silu",
            "rms_norm_eps": llm.norm_eps, "rope_theta": llm.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": llm.rope_theta},
            "tie_word_embeddings": llm.tie_embeddings, "attention_bias": False, "mlp_bias": False,
            "max_position_embeddings": 4096, "torch_dtype": dtype, "dtype": dtype}


_LAYER = {"attn_norm.weight": "input_layernorm.weight",
          "mlp_norm.weight": "post_attention_layernorm.weight",
          **{f"attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
          **{f"mlp.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}}


def hf_names(llm) -> dict[str, str]:
    """Every `llm` parameter of the whole model (all stages) -> its transformers key."""
    names = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not llm.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(llm.num_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}"
                      for ours, theirs in _LAYER.items()})
    return names


def sources(llm, ckpt: HFCheckpoint) -> dict[str, Source]:
    """Where each `llm` parameter is in `ckpt`: its own key, or a row range of a fused
    `qkv_proj` / `gate_up_proj` when the checkpoint has that instead."""
    d = llm.hidden_size // llm.num_heads
    fused = {"self_attn.q_proj": ("self_attn.qkv_proj", 0, llm.num_heads * d),
             "self_attn.k_proj": ("self_attn.qkv_proj", llm.num_heads * d, llm.num_kv_heads * d),
             "self_attn.v_proj": ("self_attn.qkv_proj", (llm.num_heads + llm.num_kv_heads) * d,
                                  llm.num_kv_heads * d),
             "mlp.gate_proj": ("mlp.gate_up_proj", 0, llm.ffn_hidden_size),
             "mlp.up_proj": ("mlp.gate_up_proj", llm.ffn_hidden_size, llm.ffn_hidden_size)}
    out = {}
    for ours, key in hf_names(llm).items():
        out[ours] = Source(key)
        if key not in ckpt.files:
            for part, (whole, start, rows) in fused.items():
                fused_key = key.replace(part, whole)
                if f".{part}." in key and fused_key in ckpt.files:
                    out[ours] = Source(fused_key, start, rows)
    return out


def ignored(llm, keys) -> dict[str, str]:
    """Tensors of a LLaMA checkpoint not loaded by design: {key: why}."""
    return {k: "recomputed" for k in keys if k.endswith(IGNORED_SUFFIXES)}
