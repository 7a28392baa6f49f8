"""Routing tables of the edges into the LLM, built by the step plan (`hcp.plan.step`) from the
packing: where every image row of the batch lands (the LLM CP rank whose head-tail chunks hold
its merged position, and its slot there), and the colocated edge's `RowTable` (one table for the
step over the world group). The non-colocated edge's tables (one per micro-batch over the edge
group) are `hcp.plan.island_routes`'. Conventions of the rows: `hcp.parallel.routing`.
"""
from __future__ import annotations

import numpy as np

from hcp.parallel import encoder_cp
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


def source_cp(sizes, cp: int) -> np.ndarray:
    """[R] the encoder CP rank holding each image row of the batch (rows in sample order), under
    encoder CP size `cp` (`hcp.parallel.encoder_cp`; all 0 for cp = 1)."""
    rows_each = sizes.image_rows_each
    if cp == 1:
        return np.zeros(int(rows_each.sum()), np.int64)
    row = np.arange(int(rows_each.sum())) - np.repeat(excl_cumsum(rows_each)[:-1], rows_each)
    return encoder_cp.row_slot(row, np.repeat(rows_each, rows_each), cp)[0]


def cp_sample_rows(sizes, cp: int, cp_rank: int) -> np.ndarray:
    """[B] image rows of each sample that encoder CP rank `cp_rank` of `cp` returns."""
    prefix = excl_cumsum(encoder_cp.rows_on_rank(sizes.image_rows_each, cp)[:, cp_rank])
    return prefix[sizes.image_offsets[1:]] - prefix[sizes.image_offsets[:-1]]


def rank_within(key: np.ndarray, part: np.ndarray, parts: int) -> np.ndarray:
    """Each entry's index among the entries of its `part` ordered by `key` (stable)."""
    order = np.lexsort((key, part))
    first = np.searchsorted(part[order], np.arange(parts))
    out = np.empty(len(key), np.int64)
    out[order] = np.arange(len(key)) - first[part[order]]
    return out


def route_into_llm(src_lay, lane_of, mb_base, J, sizes, llm, s_group, doc_start, size, off,
                   mb_of_group):
    """The RowTable of a colocated edge from an encoder-side module into the LLM, and the image
    rows per (pool position, micro-batch) [pool, J]. `lane_of` [B]: the source lane of each
    sample (colocated: lane l encodes block l of the batch)."""
    pool = llm.dp * llm.cp
    sample, shard, mb, local = image_rows(sizes, llm, s_group, doc_start, size, off, mb_of_group)
    R = len(sample)
    # source: the sample's lane; the encoder CP rank holding the row (its chunk of the image),
    # whose rows keep sample order; TP replica floor(p * tp / R) sends its row p (contiguous,
    # balanced)
    cp, tp = src_lay.cp, src_lay.tp
    lane = lane_of[sample]
    src_cp = source_cp(sizes, cp)
    part = lane * cp + src_cp
    src_row = rank_within(np.arange(R), part, src_lay.dp * cp)
    part_rows = np.bincount(part, minlength=src_lay.dp * cp)
    replica = src_row * tp // np.maximum(part_rows[part], 1)
    src = Grid.of(src_lay).ranks[0, lane, src_cp, replica]
    # destination: the CP rank whose head-tail chunks hold the row's merged position
    stream = mb_base[mb, shard] + local
    dst_row = rank_within(stream, shard, pool)
    counts = np.bincount(shard * J + mb, minlength=pool * J).reshape(pool, J)
    shard_ranks = Grid.of(llm).ranks[0].reshape(pool, llm.tp)
    return RowTable(src, src_row, shard, dst_row, shard_ranks, llm.num_ranks), counts
