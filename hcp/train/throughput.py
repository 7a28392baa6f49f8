"""Per-step throughput metrics: model FLOPs, TFLOPS/GPU, peak memory, pipeline bubble.

Model FLOPs (DESIGN.md section 5) count the REAL tokens of the global batch through the LLM
decoder and its LM head, 3 x forward (backward = 2 x forward); activation recompute is NOT
counted (it is extra work, not model progress), CP/SP padding is not counted, the vision encoder
and projector are not counted (small next to the decoder in LLaVA). Per layer, forward:
`2 * T * P_layer` for the matrix multiplies (P_layer = q, k, v, o and the SwiGLU weights) plus
`2 * h * sum_i L_i^2` for causal attention scores and values over the documents' lengths L_i
(ragged: each document attends only to itself); plus `2 * T * h * V` for the LM head.
A ratio of TFLOPS for the same batch is the inverse ratio of step time.
"""
from __future__ import annotations

import resource

import torch
import torch.distributed as dist


def model_flops(llm_cfg, tokens: float, sum_sq_lengths: float) -> float:
    """Training FLOPs (3 x forward) of `tokens` real tokens whose documents have
    sum of squared lengths `sum_sq_lengths` (tokens^2)."""
    h, f, v = llm_cfg.hidden_size, llm_cfg.ffn_hidden_size, llm_cfg.vocab_size
    kv = h * llm_cfg.num_kv_heads // llm_cfg.num_heads
    layer_params = 2 * h * h + 2 * h * kv + 3 * h * f          # q, o; k, v; gate, up, down
    layer = 2 * tokens * layer_params + 2 * h * sum_sq_lengths
    return 3.0 * (llm_cfg.num_layers * layer + 2 * tokens * h * v)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated CUDA memory on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def step_metrics(llm_cfg, counts: list[float], step_s: float, times, device) -> dict:
    """TFLOPS/GPU, max peak memory over ranks (GiB) and the pipeline bubble fraction (mean over
    ranks of 1 - busy / wall of the 1F1B schedule, from each stage's measured compute time).

    counts: [global loss tokens, global tokens, global sum of squared document lengths];
    times: this rank's `StageTimes`. A collective over the world (every rank calls it)."""
    world = dist.get_world_size()
    peak = torch.tensor([peak_memory_bytes(device)], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    bubble = torch.tensor([1.0 - times.busy_s / max(times.wall_s, 1e-12)], dtype=torch.float64,
                          device=device)
    dist.all_reduce(bubble)
    flops = model_flops(llm_cfg, counts[1], counts[2])
    return {"tflops_per_gpu": flops / step_s / world / 1e12, "peak_memory_gib": peak.item() / 2**30,
            "bubble_fraction": bubble.item() / world}
