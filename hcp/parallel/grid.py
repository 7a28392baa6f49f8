"""A module's grid of ranks and the rank lists of its process groups (docs/design.md section 3).

The grid is the box of ranks `[rank_offset, rank_offset + tp*cp*dp*pp)` with axis order tp
(fastest), cp, dp, pp (slowest), so a rank's coordinates are

    local = rank - rank_offset
    tp = local % TP,  cp = local // TP % CP,  dp = local // (TP*CP) % DP,  pp = local // (TP*CP*DP)

`Grid.ranks` holds them as an array of shape [pp, dp, cp, tp]. A group kind names the axes that
vary inside a group; every other axis is fixed, so each rank is in exactly one group of each kind:

| kind  | axes     | use |
| ----- | -------- | --- |
| tp    | tp       | tensor parallel |
| cp    | cp       | context parallel |
| dp    | dp       | data parallel (replicas of the same shard) |
| pp    | pp       | pipeline (one rank per stage) |
| dp_cp | dp, cp   | gradient reduction; also the dynamic-CP pool (cp fastest, then dp) |
| tp_cp | tp, cp   | boundary broadcast from an edge's leader |
| mp    | tp, pp   | model parallel in Megatron's sense: the ranks holding one full model copy's
shards within one dp and cp index |

Dynamic CP: for each power of two s dividing the pool size dp*cp, the pool of one (pp, tp) index
is cut into aligned contiguous blocks of s ranks, in pool order (`dynamic_cp_groups(s)`).
Everything here is numpy arithmetic: fast at thousands of ranks, no process group.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

AXES = ("pp", "dp", "cp", "tp")
"""Array axis order of `Grid.ranks`, slowest first."""
KINDS = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",), "dp_cp": ("dp", "cp"),
         "tp_cp": ("cp", "tp"), "mp": ("pp", "tp")}
"""Group kind -> the axes varying inside one group (in array order)."""
DYNAMIC_CP = "dynamic_cp"
"""Kind of the dynamic-CP block groups (hcp/parallel/groups.py); looked up with a `size`."""


@dataclass(frozen=True)
class Grid:
    """Sizes and rank offset of one module's grid (ranks)."""

    tp: int
    cp: int
    dp: int
    pp: int
    rank_offset: int = 0

    @classmethod
    def of(cls, layout) -> "Grid":
        """The grid of a `hcp.config.layouts.ResolvedLayout`."""
        return cls(layout.tp, layout.cp, layout.dp, layout.pp, layout.rank_offset)

    @property
    def size(self) -> int:
        """Ranks in the grid."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(pp, dp, cp, tp)."""
        return self.pp, self.dp, self.cp, self.tp

    @cached_property
    def ranks(self) -> np.ndarray:
        """Global ranks as int64 [pp, dp, cp, tp]."""
        return self.rank_offset + np.arange(self.size, dtype=np.int64).reshape(self.shape)

    def contains(self, rank: int) -> bool:
        return self.rank_offset <= rank < self.rank_offset + self.size

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates {tp, cp, dp, pp} of a rank. Raises ValueError outside the grid."""
        if not self.contains(rank):
            raise ValueError(f"rank {rank} is outside the grid [{self.rank_offset}, "
                             f"{self.rank_offset + self.size})")
        idx = np.unravel_index(rank - self.rank_offset, self.shape)
        return {axis: int(i) for axis, i in zip(AXES, idx)}

    def rank_at(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at the given coordinates."""
        return int(self.ranks[pp, dp, cp, tp])

    def groups(self, kind: str) -> np.ndarray:
        """Every group of a kind as int64 [num_groups, group_size], rows in ascending order of
        the fixed coordinates, ranks ascending within a row. Raises KeyError for an unknown kind."""
        varying = [AXES.index(a) for a in KINDS[kind]]
        fixed = [i for i in range(4) if i not in varying]
        size = int(np.prod([self.shape[i] for i in varying]))
        return self.ranks.transpose(fixed + varying).reshape(-1, size)

    def group_index(self, kind: str, rank: int) -> int:
        """Row of `groups(kind)` that holds `rank` (O(1))."""
        c = self.coords(rank)
        fixed = [a for a in AXES if a not in KINDS[kind]]
        dims = [self.shape[AXES.index(a)] for a in fixed]
        return int(np.ravel_multi_index([c[a] for a in fixed], dims)) if fixed else 0

    def group_of(self, kind: str, rank: int) -> np.ndarray:
        """The ranks of the `kind` group holding `rank` (O(group size))."""
        return self.groups(kind)[self.group_index(kind, rank)]

    @property
    def cp_pool(self) -> int:
        """Ranks per dynamic-CP pool: dp * cp."""
        return self.dp * self.cp

    def dynamic_cp_sizes(self) -> list[int]:
        """Powers of two s (1, 2, 4, ...) that divide the pool size dp*cp."""
        sizes, s = [], 1
        while self.cp_pool % s == 0:
            sizes.append(s)
            s *= 2
        return sizes

    def dynamic_cp_groups(self, size: int) -> np.ndarray:
        """Aligned contiguous blocks of `size` ranks of every CP pool, int64 [num_blocks, size].

        Rows: pools in (pp, tp) order, then blocks in pool order. Raises ValueError when `size`
        is not one of `dynamic_cp_sizes()`.
        """
        if size not in self.dynamic_cp_sizes():
            raise ValueError(f"dynamic CP size {size} is not a power of two dividing dp*cp = "
                             f"{self.cp_pool}")
        return self.groups("dp_cp").reshape(-1, size)

    def dynamic_cp_index(self, size: int, rank: int) -> int:
        """Row of `dynamic_cp_groups(size)` that holds `rank` (O(1))."""
        c = self.coords(rank)
        pool_pos = c["dp"] * self.cp + c["cp"]
        return self.group_index("dp_cp", rank) * (self.cp_pool // size) + pool_pos // size
