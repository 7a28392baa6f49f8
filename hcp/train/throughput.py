"""Per-step throughput metrics: model FLOPs, TFLOPS/GPU, peak memory, idle (bubble) fraction.

Model FLOPs: hcp/model/flops.py (the one implementation; docs/design.md section 5): the REAL
tokens of the global batch through the LLM decoder and its LM head, 3 x forward, ragged causal
attention; recompute, padding and the vision encoder are not counted.
A ratio of TFLOPS for the same batch is the inverse ratio of step time.
"""
from __future__ import annotations

import resource

import torch
import torch.distributed as dist

from hcp.model.flops import model_flops
from hcp.train.fake import host_values


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated CUDA memory on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def step_metrics(llm, counts: list[float], step_s: float, times, device, preempt=None) -> dict:
    """TFLOPS/GPU, max peak memory over ranks (GiB) and `bubble_fraction`: the mean over ranks of
    1 - busy / wall of the step's schedule (`times`: busy, the rank's forward/backward compute;
    wall, the whole action list, not data loading or the optimizer step). It counts the pipeline
    bubble and the waits inside the schedule (sends, receives, collectives), so it can be above
    zero at pp 1.

    llm: the LLM's architecture (`hcp.config.specs.LLMArch`, for its FLOPs);
    counts: [global loss tokens, global tokens, global sum of squared document lengths];
    times: this rank's `StageTimes`; preempt: this rank's `hcp.launch.preempt.Preemption` (or
    None): its signal flag rides in the same collective and every rank gets the largest
    (`Preemption.agree`), so the step has one collective and one host read for both.
    A collective over the world (every rank calls it)."""
    world = dist.get_world_size()
    flag = float(preempt.received) if preempt is not None else 0.0
    mine = torch.tensor([peak_memory_bytes(device), 1.0 - times.busy_s / max(times.wall_s, 1e-12), flag],
                        dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)  # one collective for all three
    every = torch.stack(every)
    peak, bubble, flag = every[:, 0].max(), every[:, 1].sum(), every[:, 2].max()
    flops = model_flops(llm, counts[1], counts[2])
    read = host_values(torch.stack([peak, bubble, flag]))  # fake tensors: no value
    peak, bubble, flag = read if read is not None else (float("nan"), float("nan"), 0.0)
    if preempt is not None:
        preempt.agree(int(flag))
    return {"tflops_per_gpu": flops / step_s / world / 1e12, "peak_memory_gib": peak / 2**30,
            "bubble_fraction": bubble / world}
