"""Ranks of a non-colocated edge's communicator group (docs/design.md 4.2). Pure, no process group.

Under `placement=non_colocated` the source module (an encoder, with its projector) and the
destination module (the LLM) sit on disjoint islands. Rows leave from the source's LAST pipeline
stage and arrive on the destination's FIRST stage, so the edge's dedicated group holds exactly
those ranks: the source's last-stage ranks, then the destination's first-stage ranks, each in
ascending global order (group rank i is `edge_ranks(...)[i]`; the edge's routing tables are
indexed by these group ranks).
"""
from __future__ import annotations

from hcp.parallel.grid import Grid


def edge_ranks(src: Grid, dst: Grid) -> tuple[int, ...]:
    """Global ranks of the edge group from `src`'s last stage to `dst`'s first stage.

    Returns the source's last-stage ranks (ascending) followed by the destination's first-stage
    ranks (ascending); the first `src.size // src.pp` group ranks are the sources.

    Raises:
        ValueError: the two grids share a rank (that edge is colocated: use
            `hcp.comm.boundary`, whose `all_to_all_single` also moves rows a rank keeps).
    """
    sources = sorted(int(r) for r in src.ranks[src.pp - 1].ravel())
    dests = sorted(int(r) for r in dst.ranks[0].ravel())
    shared = set(range(src.rank_offset, src.rank_offset + src.size)) & set(
        range(dst.rank_offset, dst.rank_offset + dst.size))
    if shared:
        raise ValueError(f"edge_ranks: the source grid (ranks {src.rank_offset}.."
                         f"{src.rank_offset + src.size - 1}) and the destination grid (ranks "
                         f"{dst.rank_offset}..{dst.rank_offset + dst.size - 1}) share rank "
                         f"{min(shared)}; a non-colocated edge needs disjoint islands (set the "
                         "layouts' rank_offset, or use placement=colocated)")
    return tuple(sources + dests)
