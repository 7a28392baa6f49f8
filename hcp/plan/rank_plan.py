"""What one rank gets of the step plan (`hcp.plan.step.StepPlan.rank`): its LLM micro-batches,
its encoder samples and micro-batches, its part of every routing table, and the global counts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hcp.parallel.routing import RankRoute


@dataclass(frozen=True)
class MicroBatchPlan:
    """One LLM micro-batch as one rank runs it. Sample indices are positions in the global batch.

    An empty micro-batch (`samples == ()`, `cu_seqlens == [0]`) pads a rank's schedule so every
    rank of its collectives runs the same count; it has no tokens, loss or image rows.
    """

    samples: tuple[int, ...]
    """Packed samples (documents) in packing order."""
    cu_seqlens: np.ndarray
    """int32 [N + 1]: merged document boundaries before CP sharding."""
    max_seqlen: int
    """Longest document (merged tokens)."""
    cp_size: int
    """Ranks of the CP group that shares the micro-batch."""
    cp_block: int
    """Index of that group among the aligned blocks of cp_size in the CP pool (docs/design.md 3)."""
    cp_rank: int
    """This rank's CP shard index inside the group (head-tail chunks r and 2c-1-r)."""
    local_tokens: int
    """Slots of this rank's CP shard: sum over documents of 2 * ceil(L / 2c) at c > 1, of L at
    c = 1 (no sharding, no padding)."""
    image_rows: tuple[int, int]
    """[start, end) of its image rows in the tensor received over the edge into the LLM (only
    on the LLM's first stage; rows in slot order of the local shard). Colocated: one tensor
    for the step; non-colocated: one tensor per micro-batch, so (0, rows) (every TP rank of
    the shard gets it, also under the `leader` route). Several edges into the LLM: the default
    stream's (`projector`, else the first edge's)."""
    stream_rows: dict = field(default_factory=dict)
    """Every edge into the LLM, by source projector: [start, end) of this micro-batch's rows
    in the tensor received over that edge (`image_rows` is one of them)."""

    @property
    def empty(self) -> bool:
        return not self.samples


@dataclass(frozen=True)
class Counts:
    """Global counts of the step (all micro-batches, lanes, CP ranks)."""

    loss_tokens: int
    tokens: int
    """Merged tokens, without CP padding."""
    sum_sq_lengths: float
    """Sum over documents of the squared merged length (attention FLOPs)."""
    image_rows: int = 0
    """Image rows (image tokens) of the whole batch (all streams into the LLM)."""
    stream_rows: dict = field(default_factory=dict)
    """Rows of the whole batch per stream into the LLM, by source projector."""


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a `StepPlan`."""

    rank: int
    encoder_samples: dict[str, tuple[int, ...]]
    """Encoder-side module -> the samples it encodes here, in order (only modules it runs)."""
    micro_batches: list[MicroBatchPlan]
    """Its LLM micro-batches in execution order (empty list when it runs no LLM stage)."""
    routes: dict[tuple[str, str], RankRoute]
    """Edge into the LLM -> this rank's part of its row exchange."""
    counts: Counts
    checksum: int = 0
    """`StepPlan.checksum()` of the whole plan (0: not computed)."""
    encoder_micro_batches: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    """Non-colocated: encoder-side module -> per LLM micro-batch j, the samples this rank's
    lane encodes as its micro-batch j (module docstring); every stage of the lane gets it."""
    island_routes: dict[tuple[str, str], tuple[RankRoute, ...]] = field(default_factory=dict)
    """Non-colocated edge into the LLM -> this rank's `RankRoute` of every micro-batch (edge
    group ranks); only ranks of the edge group have an entry."""
    encoder_inputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Non-colocated: encoder-side module -> per micro-batch, the inputs (images) of its
    encoder that this rank's lane encodes (the shapes of the island's pipeline)."""
    encoder_rows: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Non-colocated: module with an edge into the LLM (a projector) -> per micro-batch, the
    rows its stream leaves this rank with (all TP replicas compute all of them; under encoder CP
    the rows of this CP rank's chunk of each input, `hcp.parallel.encoder_cp`)."""
    keep_empty: bool = False
    """Run the empty micro-batches too (`StepPlan.keep_empty`)."""
    overlap_grad_sync: bool = True
    """The gradient reduction may start in the last backward (`StepPlan.overlap_grad_sync`)."""
    actions: list = field(default_factory=list)
    """Its action list of the step (`hcp.plan.actions.rank_actions`), run by the one executor."""
