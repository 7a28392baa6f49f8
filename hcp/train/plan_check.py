"""Every step, before any of its collectives: do all ranks hold the same step plan?

Every rank computes the step plan itself (docs/design.md 4.1); the dynamic-CP solver breaks ties on
floats and runs HiGHS LPs, so ranks on different CPUs or library builds could pick different
plans and then hang a collective. `check_plans_agree` all-reduces the plan's 63-bit checksum
(`hcp.plan.step.StepPlan.checksum`) as one int64 [2] tensor `[c, -c]` with MAX over the world:
the ranks agree iff max(c) == min(c). One tiny collective that every rank issues whatever its
plan, so disagreement cannot hang it, and every rank raises the same error naming the step.
Its one host read per step comes before the step's work (`trainer.check_plan`, on by default).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hcp.parallel.upload import upload
from hcp.train.fake import is_fake


def check_plans_agree(checksum: int, step: int, device, group=None) -> None:
    """Raise RuntimeError on every rank of `group` (default: the world) unless they all passed
    the same `checksum` (an int in [0, 2**63)) for step `step` (1-based, as logged)."""
    if not 0 <= checksum < 2**63:
        raise ValueError(f"plan checksum {checksum} is outside [0, 2**63)")
    t = upload([checksum, -checksum], device, torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if is_fake(t):  # the rehearsal: the all-reduce is issued, its values are not there
        return
    high, low = t.tolist()
    low = -low
    if high != low:
        raise RuntimeError(
            f"step {step}: the ranks computed different step plans (checksums from {low:#018x} to "
            f"{high:#018x}; this rank's {checksum:#018x}), so the step's collectives would hang. "
            "Every rank must run the same code, config, data and length index, and the same "
            "library builds (numpy, highspy); compare the ranks' logs of this line to find the odd "
            "one")
