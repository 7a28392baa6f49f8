"""Routing tables of the edges into the LLM, built by the step plan (`hcp.plan.step`) from the
packing: where every image row of the batch lands (the LLM CP rank whose head-tail chunks hold
its merged position, and its slot there), and the colocated edge's `RowTable` (one table for the
step over the world group). The non-colocated edge's tables (one per micro-batch over the edge
group) are `hcp.plan.island_routes`'. Conventions of the rows: `hcp.parallel.routing`.
"""
from __future__ import annotations

import numpy as np

from hcp.parallel.grid import Grid
from hcp.parallel.routing import RowTable, cp_slot


def excl_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x) + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def image_rows(sizes, llm, s_group, doc_start, size, off, mb_of_group):
    """Every image row of the batch (rows in sample order): (sample, merged position in it,
    destination pool position, micro-batch, slot in that position's part of the micro-batch)."""
    rows_each = sizes.image_rows_each
    R = int(rows_each.sum())
    img_first = excl_cumsum(rows_each)
    pos_in_sample = np.repeat(sizes.image_starts - img_first[:-1], rows_each) + np.arange(R)
    sample = np.repeat(np.arange(len(sizes)), sizes.image_rows)
    g = s_group[sample]
    cp_rank, slot = cp_slot(pos_in_sample, sizes.tokens[sample], size[g])
    return sample, off[g] + cp_rank, mb_of_group[g], doc_start[sample] + slot


def rank_within(key: np.ndarray, part: np.ndarray, parts: int) -> np.ndarray:
    """Each entry's index among the entries of its `part` ordered by `key` (stable)."""
    order = np.lexsort((key, part))
    first = np.searchsorted(part[order], np.arange(parts))
    out = np.empty(len(key), np.int64)
    out[order] = np.arange(len(key)) - first[part[order]]
    return out


def route_into_llm(src_lay, mb_base, J, sizes, llm, s_group, doc_start, size, off, mb_of_group):
    """The RowTable of a colocated edge from an encoder-side module into the LLM, and the image
    rows per (pool position, micro-batch) [pool, J]."""
    pool = llm.dp * llm.cp
    sample, shard, mb, local = image_rows(sizes, llm, s_group, doc_start, size, off, mb_of_group)
    R = len(sample)
    row_off = excl_cumsum(sizes.image_rows)
    # source: lane block; TP replica floor(p * tp / R) sends lane row p (contiguous, balanced)
    n = len(sizes) // src_lay.dp
    lane = sample // n
    lane_first = row_off[np.arange(src_lay.dp) * n]
    lane_rows = row_off[np.arange(1, src_lay.dp + 1) * n] - lane_first
    src_row = np.arange(R) - lane_first[lane]
    tp = src_lay.tp
    replica = src_row * tp // np.maximum(lane_rows[lane], 1)
    src = Grid.of(src_lay).ranks[0, lane, 0, replica]
    # destination: the CP rank whose head-tail chunks hold the row's merged position
    stream = mb_base[mb, shard] + local
    dst_row = rank_within(stream, shard, pool)
    counts = np.bincount(shard * J + mb, minlength=pool * J).reshape(pool, J)
    shard_ranks = Grid.of(llm).ranks[0].reshape(pool, llm.tp)
    return RowTable(src, src_row, shard, dst_row, shard_ranks, llm.num_ranks), counts
