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
from hcp.parallel.upload import upload
from hcp.train.fake import host_values


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated CUDA memory on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def rate_metrics(llm, counts: list[float], step_s: float, world: int) -> dict:
    """`tokens_per_s`, `step_time_s` and TFLOPS/GPU of a step of `step_s` seconds (no collective).

    llm: the LLM's architecture (`hcp.config.specs.LLMArch`, for its FLOPs);
    counts: [global loss tokens, global tokens, global sum of squared document lengths]."""
    return {"tokens_per_s": counts[1] / step_s, "step_time_s": step_s,
            "tflops_per_gpu": model_flops(llm, counts[1], counts[2]) / step_s / world / 1e12}


class WorldStats:
    """Each step's world-wide figures: max peak memory over ranks (`peak_memory_gib`), the mean
    `bubble_fraction` over ranks (1 - busy / wall of the step's schedule: `times` is the rank's
    `StageTimes`; busy, its forward/backward compute; wall, the whole action list, not data
    loading or the optimizer step; it counts the pipeline bubble and the waits inside the
    schedule, so it can be above zero at pp 1), and the preemption flag of `preempt` (a
    `hcp.launch.preempt.Preemption`, or None; every rank gets the largest: `Preemption.agree`).

    `watch` (a `hcp.train.stragglers.StragglerWatch`, or None) gets every rank's compute and
    data-wait seconds of each step from the same gather.

    One world all-gather per step, issued without waiting (`async_op`) at the end of step s and
    read at the end of step s+1 (or by `settle`), so it is no sync point on the step's critical
    path: step s's metrics dict gets its two figures one step late, and the ranks agree to stop
    one step after the signal. Every rank issues and settles at the same steps whatever its data.
    """

    def __init__(self, device: torch.device, preempt=None, watch=None):
        self.device, self.preempt, self.watch = device, preempt, watch
        # (metrics dict, gathered rows, own row, async work) of the last issued step
        self.pending = None

    def issue(self, metrics: dict, times, data_wait_s: float = 0.0) -> None:
        """Settle the previous step's figures, then gather this step's (into `metrics` later).
        `data_wait_s`: this rank's wait for its data this step (for `watch`)."""
        self.settle()
        flag = float(self.preempt.received) if self.preempt is not None else 0.0
        mine = upload([peak_memory_bytes(self.device),
                       1.0 - times.busy_s / max(times.wall_s, 1e-12), flag,
                       times.busy_s, data_wait_s], self.device, torch.float64)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        self.pending = (metrics, every, mine, dist.all_gather(every, mine, async_op=True))

    def settle(self) -> None:
        """Wait for the step in flight (if any): fill its metrics dict with `peak_memory_gib` and
        `bubble_fraction` (NaN under fake tensors) and let every rank agree on the preemption
        flag."""
        if self.pending is None:
            return
        metrics, every, _, work = self.pending
        self.pending = None
        work.wait()
        every = torch.stack(every)
        ranks = every[:, 3:].T.flatten() if self.watch is not None else every[:0, 0]  # logging rank
        read = host_values(torch.cat([torch.stack([every[:, 0].max(), every[:, 1].mean(),
                                                   every[:, 2].max()]), ranks]))
        peak, bubble, flag = read[:3] if read is not None else (float("nan"), float("nan"), 0.0)
        if self.watch is not None and read is not None:  # each rank's compute, then data wait
            self.watch.add(read[3:3 + len(every)], read[3 + len(every):])
        if self.preempt is not None:
            self.preempt.agree(int(flag))
        metrics.update(peak_memory_gib=peak / 2**30, bubble_fraction=bubble)
