"""Megatron-Core's real hybrid-CP scheduler as a peer planner (benchmarks only).

Runs `megatron.core.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler` (package
`megatron-core`, optional extra `bench`; never needed to train) on a batch of lengths and
converts its output to our `Packing`, faithfully to how Megatron executes it
(`hybrid_context_parallel_forward_backward` in the same file):
- each element of `get_groups_and_subsamples`' `sample_id_groups` is a round: the DPxCP ranks
  run it between two barriers of the DPxCP group;
- in a round, rank r runs the sub-samples `sample_id_groups[round][r]` one after another, each
  as its own forward and backward (one micro-batch per sequence, no packing);
- the ranks that list the same sub-samples form its CP group (`local_cp_size` is the number of
  ranks holding a sample), so each group of c ranks becomes one `Group` with one micro-batch
  per sequence, in Megatron's order.
Groups are laid out largest first (aligned blocks): where on the pool a group sits does not
change its time in our cost model (only its size does), and our plans require aligned blocks.
The pool object Megatron's constructor needs is any object with `size()`.
"""
from __future__ import annotations

import numpy as np

from hcp.dcp.packing import Group, Packing, Round, fill_idle


class _Pool:
    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n


def megatron_plan(lengths, pool: int, max_tokens_per_rank: int) -> Packing:
    """Megatron-Core's BalancedCPScheduler plan of these lengths (tokens) on `pool` ranks.

    Raises:
        ImportError: megatron-core is not installed (`pip install -e .[bench]`).
        ValueError: Megatron's output does not place every sequence exactly once in groups of
            identical sample lists (a conversion that would not be faithful).
    """
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    lens = [int(x) for x in np.asarray(lengths)]
    sched = BalancedCPScheduler(max_tokens_per_rank, _Pool(pool))
    _, sample_id_groups = sched.get_groups_and_subsamples(list(enumerate(lens)), None)
    plan = Packing()
    seen = np.zeros(len(lens), dtype=np.int64)
    for j, per_rank in enumerate(sample_id_groups):
        per_rank = [list(ids) for ids in per_rank] + [[]] * (pool - len(per_rank))
        blocks: dict[tuple, int] = {}
        for ids in per_rank:
            if ids:
                blocks[tuple(ids)] = blocks.get(tuple(ids), 0) + 1
        sizes = sorted(blocks.items(), key=lambda kv: -kv[1])
        groups, off = [], 0
        for ids, c in sizes:
            if c & (c - 1):
                raise ValueError(f"round {j}: Megatron put samples {ids} on {c} ranks, not a "
                                 f"power of two")
            groups.append(Group(list(ids), c, off, [1] * len(ids)))
            seen[list(ids)] += 1
            off += c
        plan.rounds.append(Round(fill_idle(groups, pool)))
    if (seen != 1).any():
        i = int(np.argmax(seen != 1))
        raise ValueError(f"Megatron's plan runs sequence {i} {int(seen[i])} times, not once")
    return plan
