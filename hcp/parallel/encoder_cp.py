"""Context parallelism inside an encoder (a ViT): which CP rank holds which tokens and output rows.

An encoder input is one bidirectional sequence of `tokens = lead + rows` (the CLS, then one token
per output row). Under encoder CP size c it is cut into c contiguous chunks of
k = ceil(tokens / c) positions, rank r holding [r*k, (r+1)*k) (padding last): with no causal mask
contiguous chunks carry equal work, and every rank holds k positions of every input. Rank r
returns each input's rows that fall in its chunk, in position order (`rows_on_rank`; `row_slot`
gives a row's rank and index). Pure numpy. Example: rows 16, lead 1, c 2: k = 9; rank 0 holds
the CLS and rows 0..7, rank 1 rows 8..15 and one padding slot."""
from __future__ import annotations

import numpy as np

LEAD = 1
"""Leading tokens of a ViT input (its CLS token), which are not output rows."""


def chunk(tokens: int, cp: int) -> int:
    """k: positions each CP rank holds of one input of `tokens` tokens."""
    return -(-tokens // cp)


def positions(tokens: int, cp: int, rank: int) -> np.ndarray:
    """int64 [k]: the positions CP rank `rank` holds of each input (>= tokens: padding)."""
    k = chunk(tokens, cp)
    return rank * k + np.arange(k, dtype=np.int64)


def output_range(rows: int, cp: int, rank: int, lead: int = LEAD) -> tuple[int, int]:
    """[a, b): the local positions of rank `rank` that are output rows (a contiguous range)."""
    pos = positions(lead + rows, cp, rank)
    keep = np.flatnonzero((pos >= lead) & (pos < lead + rows))
    return (int(keep[0]), int(keep[-1]) + 1) if len(keep) else (0, 0)


def rows_on_rank(rows, cp: int, lead: int = LEAD) -> np.ndarray:
    """int64 [..., cp]: output rows each CP rank holds of an input of `rows` rows (element-wise)."""
    rows = np.asarray(rows, dtype=np.int64)[..., None]
    k = -(-(rows + lead) // cp)
    start = np.arange(cp, dtype=np.int64) * k
    return np.clip(np.minimum(start + k, lead + rows) - np.maximum(start, lead), 0, None)


def row_slot(row, rows, cp: int, lead: int = LEAD):
    """(CP rank, index among that rank's rows of the same input) of output row `row` of an input
    of `rows` rows; element-wise over int arrays."""
    row, rows = np.asarray(row, dtype=np.int64), np.asarray(rows, dtype=np.int64)
    k = -(-(rows + lead) // cp)
    pos = row + lead
    rank = pos // k
    return rank, pos - rank * k - np.where(rank == 0, lead, 0)
