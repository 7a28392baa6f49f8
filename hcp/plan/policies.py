"""Packing policies of the step plan (docs/design.md 4.1): each maps the global batch's merged
lengths to a `hcp.dcp.packing.Packing` over the LLM's CP pool (dp * cp ranks of one pipeline stage
and TP index, pool position = dp * cp + cp): micro-batches in execution order, each a set of groups
(samples, CP size c, aligned block offset) tiling the pool, so every rank of the pool runs the
same number of micro-batches (a rank whose group is empty runs an empty micro-batch).

`first_fit` is the static packing: DP lane l takes the contiguous block l of the global batch and
packs it first-fit (each document taking `cp * tokens_per_rank(L, cp)` slots of the lane's
capacity micro_batch_tokens * cp: padded to 2*cp at cp > 1, whole at cp = 1), at block offset l*cp
with c = cp. `dynamic_cp` (`hcp.dcp.policy`) registers its solver with
`register_policy`.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from hcp.data.host import first_fit
from hcp.dcp.packing import Group, Packing, Round, rank_tokens

Policy = Callable[[np.ndarray, object, int], Packing]
"""(merged lengths int64 [B], the LLM's ResolvedLayout, micro_batch_tokens) -> Packing over the
LLM's CP pool whose groups hold positions in the global batch."""

_POLICIES: dict[str, Policy] = {}


def register_policy(name: str, policy: Policy) -> None:
    """Make `policy` the packing policy `packing=name` (replaces an earlier one)."""
    _POLICIES[name] = policy


def policy(name: str) -> Policy:
    """The policy registered as `packing=name`. Raises ValueError for an unknown name."""
    if name not in _POLICIES:
        raise ValueError(f"packing={name!r} has no registered policy: use one of "
                         f"{sorted(_POLICIES)}")
    return _POLICIES[name]


def first_fit_policy(tokens: np.ndarray, llm, micro_batch_tokens: int) -> Packing:
    """Static lanes, first-fit inside each lane (module docstring); lanes with fewer packs get
    empty groups, so every lane runs the same number of micro-batches.

    Raises ValueError: the batch does not split into llm.dp lanes, or a sample exceeds the cap.
    """
    dp, cp = llm.dp, llm.cp
    if len(tokens) % dp:
        raise ValueError(f"trainer.global_batch_size={len(tokens)} is not divisible by llm dp={dp}")
    n = len(tokens) // dp
    padded = (cp * rank_tokens(tokens, cp)).tolist()
    lanes = [first_fit(padded[lane * n:(lane + 1) * n], micro_batch_tokens * cp)
             for lane in range(dp)]
    return Packing([Round([Group([lane * n + i for i in packs[j]] if j < len(packs) else [], cp,
                                   lane * cp) for lane, packs in enumerate(lanes)])
                 for j in range(max(map(len, lanes)))])


register_policy("first_fit", first_fit_policy)
