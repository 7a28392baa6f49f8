"""Model FLOPs of the LLaMA decoder: the one implementation (docs/design.md section 5); and
`encoder_flops`, the ViT encoder side's training FLOPs (the layout search and benchmarks).

Per transformer layer, forward, for documents of lengths `L_i` (T = sum L_i tokens), following
Megatron-LM's per-layer count (`num_floating_point_operations` in
`megatron/training/training.py`) with the causal attention term made ragged:
    matmuls   2 * T * P_layer,  P_layer = 2 h^2 + 2 h d_kv + 3 h f  (Q, O; K, V; SwiGLU)
              (= Megatron's 4 T h (h + h g / n) + 6 T h f, g KV heads of n, d_kv = h g / n)
    attention 2 * h * sum_i L_i^2  (QK^T and AV, each 2 L^2 h halved by the causal mask)
plus the LM head `2 T h V` once. Training counts 3 x forward (backward = 2 x forward);
activation recompute, CP/SP padding and the vision encoder are not model FLOPs.

`llm` is any object with the `LLMConfig` fields `hidden_size`, `num_layers`, `num_heads`,
`num_kv_heads`, `ffn_hidden_size`, `vocab_size` (hcp/config/schema.py). Pure Python.
"""
from __future__ import annotations


def kv_dim(llm) -> int:
    """Width of K (and of V) per token: `h * g / n`."""
    return llm.hidden_size * llm.num_kv_heads // llm.num_heads


def layer_matmul_flops_per_token(llm) -> float:
    """Forward matmul FLOPs of one layer per token: `2 * P_layer` (norms ignored)."""
    h = llm.hidden_size
    return 2.0 * (2 * h * h + 2 * h * kv_dim(llm) + 3 * h * llm.ffn_hidden_size)


def layer_recompute_matmul_flops_per_token(llm) -> float:
    """Matmul FLOPs per token that full recompute re-runs in one layer's backward: the layer's
    forward but its last matmul, the MLP down projection `2 h f` (torch's non-reentrant
    checkpoint stops re-running once the tensors the backward saved are back, and no backward
    needs that projection's output)."""
    return layer_matmul_flops_per_token(llm) - 2.0 * llm.hidden_size * llm.ffn_hidden_size


def layer_attention_flops_per_sq_token(llm) -> float:
    """Forward causal-attention FLOPs of one layer per unit of `sum_i L_i^2`: `2 * h`."""
    return 2.0 * llm.hidden_size


def head_flops_per_token(llm) -> float:
    """Forward FLOPs of the LM head per token: `2 * h * V`."""
    return 2.0 * llm.hidden_size * llm.vocab_size


def model_flops(llm, tokens: float, sum_sq_lengths: float) -> float:
    """Training FLOPs (3 x forward) of `tokens` real tokens whose documents have the sum of
    squared lengths `sum_sq_lengths` (tokens^2)."""
    layer = (layer_matmul_flops_per_token(llm) * tokens
             + layer_attention_flops_per_sq_token(llm) * sum_sq_lengths)
    return 3.0 * (llm.num_layers * layer + head_flops_per_token(llm) * tokens)


def encoder_flops(vision, llm_hidden: int, images: float) -> float:
    """Training FLOPs (3 x forward) of a ViT (`VisionConfig` fields) + mlp2x_gelu projector into
    width `llm_hidden` over `images` images: matrix multiplies 2 * tokens * weights per used
    block, attention 4 * S^2 * D per image and block (S = patches + CLS), patch embedding and
    projector over the patches."""
    p = (vision.image_size // vision.patch_size) ** 2
    s, d, f = p + 1, vision.hidden_size, vision.ffn_hidden_size
    used = vision.num_layers + vision.select_layer + 1
    block = 2 * s * (4 * d * d + 2 * d * f) + 4 * s * s * d
    embed = 2 * p * vision.num_channels * vision.patch_size ** 2 * d
    projector = 2 * p * (d * llm_hidden + llm_hidden * llm_hidden)
    return 3.0 * images * (used * block + embed + projector)
