"""The non-colocated part of the step plan (docs/design.md 4.1, 4.4): island heads and the routing
tables of edges from an encoder island into the LLM.

A module on an encoder's island (the projector) runs with the island head's layout. The island's
DP lanes share the batch's inputs evenly (`balanced_lanes`); each lane encodes its samples as one
encoder micro-batch per LLM micro-batch, in the LLM's consumption order
(`RankPlan.encoder_micro_batches`), and each micro-batch has its own routing table over the
edge group (`hcp.parallel.islands.edge_ranks`: the encoder's last-stage ranks, then the LLM's
first-stage ranks): a source sends its micro-batch's rows in sample order (under encoder CP, its
chunk's rows), a destination receives its CP shard's image rows in slot order
(`RankPlan.island_routes`; `MicroBatchPlan.image_rows == (0, rows)`). Destination TP
(`island_route`): `leader` (default: TP rank 0 receives and broadcasts) or `direct`."""
from __future__ import annotations

import heapq

import numpy as np

from hcp.parallel.routing import RowTable
from hcp.plan.routes import excl_cumsum, image_rows, rank_within, source_cp


def same_span(a, b) -> bool:
    """Whether layouts `a` and `b` span the same ranks."""
    return a.rank_offset == b.rank_offset and a.num_ranks == b.num_ranks


def island_head(layouts, edges, module: str) -> str:
    """The module whose layout `module` runs under: itself, or under non-colocated placement
    the encoder heading its island (walking back over edges between modules on the same ranks,
    e.g. projector -> vision). Colocated modules keep their own layouts."""
    if same_span(layouts[module], layouts["llm"]):
        return module
    head = module
    while True:
        prev = next((a for a, b in edges if b == head and a in layouts and a != "llm"
                     and same_span(layouts[a], layouts[head])), None)
        if prev is None:
            return head
        head = prev


def balanced_lanes(inputs: np.ndarray, micro_batch: np.ndarray, consume: np.ndarray,
                   dp: int) -> np.ndarray:
    """int64 [B]: the DP lane of an encoder island that encodes each sample, from `inputs` [B]
    (the encoder's inputs per sample: each costs the same FLOPs), the LLM micro-batch that
    consumes it `micro_batch` [B] and its consumption position `consume` [B].

    Greedy list scheduling (Graham 1969) in the order the LLM consumes the micro-batches: within
    each, samples with more inputs first; each sample goes to the lane with the fewest inputs so
    far (ties: fewer samples, then the lower lane). So the lanes' inputs differ by at most the
    most inputs of one sample over the step and over every prefix of micro-batches, which graph
    1F1B feeds to the LLM in that order. Static blocks (lane l taking block l) leave a lane with as
    many more inputs as the data happens to put in its block. Pure and deterministic (every rank
    computes the same lanes); a lane may get more samples than another (samples without inputs cost
    it nothing)."""
    lane = np.zeros(len(inputs), np.int64)
    heap = [(0, 0, d) for d in range(dp)]
    for s in np.lexsort((consume, -np.asarray(inputs), micro_batch)).tolist():
        load, count, d = heapq.heappop(heap)
        lane[s] = d
        heapq.heappush(heap, (load + int(inputs[s]), count + 1, d))
    return lane


def route_from_island(src_lay, lane_of, consume, variant, J, sizes, llm, s_group, doc_start, size,
                      off, mb_of_group):
    """One RowTable per micro-batch of a non-colocated edge into the LLM (group ranks of
    `edge_ranks`: the source's last-stage ranks lane-major, then CP, TP fastest, then the LLM's
    first-stage ranks in pool order, TP fastest), and the image rows per (pool position,
    micro-batch) [pool, J]. `lane_of` [B]: the source lane of each sample (`balanced_lanes`)."""
    pool = llm.dp * llm.cp
    sample, shard, mb, local = image_rows(sizes, llm, s_group, doc_start, size, off, mb_of_group)
    tp, cp = src_lay.tp, src_lay.cp
    lane = lane_of[sample]
    # source row: the rows of the lane's micro-batch that its CP rank holds (encoder CP: its
    # chunk of each image), samples in consumption order (rows in order)
    holder = lane * cp + source_cp(sizes, cp)
    part = holder * J + mb
    src_row = rank_within(consume[sample] * (int(sizes.image_rows.max(initial=0)) + 1)
                           + np.arange(len(sample)) - excl_cumsum(sizes.image_rows)[sample],
                           part, src_lay.dp * cp * J)
    part_rows = np.bincount(part, minlength=src_lay.dp * cp * J)
    replica = src_row * tp // np.maximum(part_rows[part], 1)
    src = holder * tp + replica
    dst_row = rank_within(local, shard * J + mb, pool * J)
    n_src = src_lay.dp * cp * tp
    reps = 1 if variant == "leader" else llm.tp
    shard_ranks = n_src + np.arange(pool)[:, None] * llm.tp + np.arange(reps)[None, :]
    group = n_src + pool * llm.tp
    tables = []
    for j in range(J):
        k = mb == j
        tables.append(RowTable(src[k], src_row[k], shard[k], dst_row[k], shard_ranks, group))
    counts = np.bincount(shard * J + mb, minlength=pool * J).reshape(pool, J)
    return tables, counts
