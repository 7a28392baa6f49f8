"""The `dynamic_cp` packing policy of the step plan (docs/design.md 4.1; hcp/plan/step.py).

`dynamic_cp_policy(llm_cfg, profile)` returns the policy `(merged lengths [B], the LLM's
ResolvedLayout, micro_batch_tokens) -> Packing` that the step plan calls through
`hcp.plan.step.register_policy("dynamic_cp", ...)` (registered by the caller: hcp/plan sits
above hcp/dcp). It runs the solver (hcp/dcp/solver.py) on the global batch with the cost model
of the run's own `llm.*` config and layout (tp strides the CP pool, pp, recompute) under the
hardware profile `packing_profile` (`h100` or a `mode=calibrate` YAML). Every rank computes
the same plan from the same lengths (the solver is deterministic: move and node budgets, no
clock), so nothing is broadcast: a broadcast would be a collective off the main thread (the plan
is computed on the plan-ahead thread, hcp/plan/ahead.py; benchmarks/dynamic_cp_broadcast.py
weighs it). With `trainer.plan_process` (default: on CUDA
ranks) the plan is computed in the plan-ahead worker process (hcp/train/planner.py), off the
training process's GIL.

Runtime (hcp/train/trainer.py `_cp_groups`, `micro_batch_group`): the pool of a TP index and
pipeline stage is the dp * cp ranks that share them (ranks strided by tp), so every TP rank of a
pool position runs the same micro-batches with its own pre-built group of each size, and every stage
of that position runs them too (the plan is computed by every rank), empty micro-batches
included under PP and dp_shard so each rank's 1F1B order (and FSDP's pool-wide all-gathers) is
the same on every rank that shares a collective.

The step plan runs rows of one micro-batch per group (`group_at[j, pool position]`), so a
round whose groups run several micro-batches (pp = 1 without dp_shard) is laid out as
`max_g n_g` rows over the same blocks; a group that has run out of micro-batches gets an
empty group there, which its ranks skip (nothing to wait for: no collective spans two groups
inside a round). So the ranks of a pool run different micro-batch counts, and the gradient
all-reduce over the pool starts after each rank's last micro-batch, never inside its backward
(`several_per_round`).

A batch with fewer sequences than pool ranks gives groups with no sequences: those ranks run
empty micro-batches, as the step plan pads any lane (never a rank left out of a collective).
"""
from __future__ import annotations

import numpy as np

from hcp.config.errors import ConfigError
from hcp.dcp.cost_model import CostModel
from hcp.dcp.hardware import load_profile
from hcp.dcp.packing import Group, Packing, Round, check_pool, prepare_lengths
from hcp.dcp.solver import solve
from hcp.parallel.grid import DYNAMIC_CP  # not groups.py: the planner imports no torch


def rows(plan: Packing) -> Packing:
    """`plan` with every round laid out as rows of one micro-batch per group (module
    docstring); a plan of one micro-batch per group is returned as it is."""
    out = Packing()
    for r in plan.rounds:
        mbs = [g.micro_batches for g in r.groups]
        for q in range(max(map(len, mbs))):
            out.rounds.append(Round([Group(m[q] if q < len(m) else [], g.cp_size, g.rank_offset)
                                     for g, m in zip(r.groups, mbs)]))
    return out


def dynamic_cp_policy(llm_cfg, profile: str = "h100"):
    """The policy for an LLM of config `llm_cfg` under the hardware profile `profile`."""
    hw = load_profile(profile)
    costs: dict[tuple, CostModel] = {}

    def policy(tokens: np.ndarray, llm, micro_batch_tokens: int) -> Packing:
        pool = llm.dp * llm.cp
        check_pool(pool, micro_batch_tokens)
        recompute = planned_recompute(llm.recompute)
        key = (llm.tp, llm.pp, recompute, tuple(llm.pp_layers))
        if key not in costs:
            layers = list(llm.pp_layers) if sum(llm.pp_layers) == llm_cfg.num_layers else None
            costs[key] = CostModel(llm_cfg, hw, pp=llm.pp, tp=llm.tp, recompute=recompute,
                                   pp_layers=layers)
        lens, _ = prepare_lengths(tokens, pool, micro_batch_tokens)
        return rows(solve(lens, costs[key], pool, micro_batch_tokens,
                          several_per_round=several_per_round(llm)).plan)

    return policy


def planned_recompute(recompute: str) -> str:
    """The recompute the planner prices for a layout's `recompute`: `full` (a backward of three
    forwards), else `none`: selective's attention-core forward only stretches each backward
    (`CostModel.core_fwd`, priced by the step estimate, `hcp.preflight.estimate`), so the plan
    of `none` stands."""
    return "full" if recompute == "full" else "none"


def several_per_round(llm) -> bool:
    """Whether a CP group of the LLM's layout `llm` may run several micro-batches in a round
    (pp = 1 without dp_shard, `hcp.dcp.packing`), so the ranks of a pool run different numbers of
    micro-batches in a step (the trainer skips the empty rows): then no collective over the
    whole pool (its gradient all-reduce) may start inside a rank's last backward
    (`hcp.plan.step.StepPlan.overlap_grad_sync`)."""
    return llm.pp == 1 and not llm.dp_shard


def cp_histogram(plan: Packing) -> dict[str, int]:
    """The step's non-empty micro-batches (groups with samples) per CP size c, as metrics
    `{"micro_batches_cp{c}": count}` in increasing c (logged each step under dynamic CP)."""
    sizes = sorted(g.cp_size for r in plan.rounds for g in r.groups if g.seq_indices)
    return {f"micro_batches_cp{c}": sizes.count(c) for c in dict.fromkeys(sizes)}


def check_dynamic_cp(cfg) -> None:
    """Before any rank starts: ConfigError naming `packing_profile` and the fix unless the
    hardware profile loads. The other dynamic-CP rules run
    in `hcp.config.validate.validate`, which every entry point calls first: a power-of-two CP
    pool (`hcp.config.layouts`) and the longest sample fitting the pool at
    `trainer.micro_batch_tokens` per rank, head-tail padding counted (`max_length`, the limit
    the planner applies)."""
    try:
        load_profile(cfg.packing_profile)
    except ValueError as err:
        problem, _, fix = str(err).partition(". Fix: ")  # a fix of its own stays the only one
        problem = problem.removeprefix(f"cost profile {cfg.packing_profile!r}: ")  # named once
        raise ConfigError("packing_profile", cfg.packing_profile, problem,
                          fix or "use h100 or the profile.yaml of mode=calibrate") from None


def micro_batch_group(groups, mb, rank: int):
    """The pre-built dynamic-CP group (hcp/parallel/groups.py, registry built with
    `dynamic_cp_modules=("llm",)`) that global rank `rank` uses for micro-batch `mb` (a
    `hcp.plan.step.MicroBatchPlan`); None at CP size 1. Never creates a group.

    Raises:
        ValueError: the plan's shard index disagrees with the rank's place in that group
            (a plan computed from other inputs: running it would hang or mix shards).
    """
    if mb.cp_size == 1:
        return None
    ranks = groups.ranks("llm", DYNAMIC_CP, mb.cp_size)
    if ranks.index(rank) != mb.cp_rank:
        raise ValueError(f"rank {rank}: the step plan gives CP shard {mb.cp_rank} of a group of "
                         f"{mb.cp_size}, but the rank is member {ranks.index(rank)} of {ranks}")
    return groups.group("llm", DYNAMIC_CP, mb.cp_size)

