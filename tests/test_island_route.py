"""Non-colocated boundary communicator (docs/design.md 4.2, 4.3): per micro-batch, rows move bit for
bit from an encoder island's last stage to the LLM island's first stage and gradients come back,
on forked gloo ranks, for every batch transform, variable rows per sample, source and
destination CP > 1, source PP > 1 and destination TP > 1 (direct and leader + broadcast).

The routing tables come from `build_routes` over hand-built keys (a stand-in for the step plan):
the LLM lanes' micro-batch i and, on each encoder lane, its samples that the LLM consumes in
micro-batch i (the order the LLM consumes them, docs/design.md 4.4). Under encoder CP each sample's
image rows are head-tail sharded over the CP ranks and leave from the rank holding them.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hcp.comm.boundary import RouteBytes
from hcp.comm.island import IslandEdge, broadcast_rows, island_backward, island_forward, warm_up
from hcp.parallel.grid import Grid
from hcp.parallel.islands import edge_ranks
from dist_utils import run_ranks
from route_utils import (Layout, build_routes, island_micro_batches, lane, micro_batches, min_route_rows,
                         random_batch, shard_keys)

H = 5
EMPTY = np.zeros(0, dtype=np.int64)


def _grid(layout: Layout, offset: int) -> Grid:
    return Grid(layout.tp, layout.cp, layout.dp, layout.pp, offset)


def island_keys(batch, enc: Layout, llm: Layout, num_micro: int, leader: bool):
    """(edge ranks, per micro-batch (src_keys, dst_keys, grad_owner, full dst keys)) by group
    rank; encoder on ranks [0, enc.size), LLM after it. `full` is what each destination rank
    ends up holding (in `leader` mode the non-leaders get it by broadcast, not by the route)."""
    n, offset = len(batch.lengths), enc.size
    ranks = edge_ranks(_grid(enc, 0), _grid(llm, offset))
    llm_mb = [micro_batches(lane(n, llm.dp, d), num_micro) for d in range(llm.dp)]
    consumed = [[s for d in range(llm.dp) for s in llm_mb[d][i]] for i in range(num_micro)]
    enc_mb = [island_micro_batches(lane(n, enc.dp, e), consumed) for e in range(enc.dp)]
    out = []
    for i in range(num_micro):
        src, dst, owner, full = [], [], [], []
        for g in ranks:
            if g < offset:
                _, cp, dp, _ = enc.coords(g)
                samples = enc_mb[dp][i]
                cu = torch.tensor([0, *np.cumsum([batch.rows[s] for s in samples])], dtype=torch.int32)
                src.append(shard_keys(cu, batch.keys(samples), enc.cp, cp))
                dst.append(EMPTY), owner.append(EMPTY.astype(bool)), full.append(EMPTY)
                continue
            tp, cp, dp, _ = llm.coords(g - offset)
            cu, key = batch.packed(llm_mb[dp][i])
            keys = shard_keys(cu, key, llm.cp, cp)
            full.append(keys)
            keys = EMPTY if leader and tp > 0 else keys
            src.append(EMPTY), dst.append(keys), owner.append(np.full(len(keys), tp == 0))
        out.append((src, dst, owner, full))
    return ranks, out


def _values(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(seed))


def _worker(rank, world, enc, llm, num_samples, num_micro, leader):
    batch = random_batch(num_samples, seed=num_samples + 3 * enc.cp + llm.cp)
    ranks, micro = island_keys(batch, enc, llm, num_micro, leader)
    group = dist.new_group(list(ranks))
    # destination TP groups (leader mode): every rank creates every group, in the same order
    first = [g for g in ranks if g >= enc.size]
    tp_groups = {tuple(first[j:j + llm.tp]): dist.new_group(first[j:j + llm.tp])
                 for j in range(0, len(first), llm.tp)}
    if rank not in ranks:
        return None
    me = ranks.index(rank)
    edge = IslandEdge(ranks, me, group)
    warm_up(edge)
    values, grads = _values(int(batch.offset[-1]), 1), _values(int(batch.offset[-1]), 2)
    counter, bcast = RouteBytes(), 0
    out = []
    for src_k, dst_k, owner, full in micro:
        route = build_routes(src_k, dst_k, owner, ranks=[me])[me]
        src = values[torch.from_numpy(src_k[me])]
        dst = island_forward(src, route, edge, counter)
        if leader and rank >= enc.size:
            members = next(m for m in tp_groups if rank in m)
            dst = broadcast_rows(dst if rank == members[0] else None, len(full[me]), H,
                                 src.dtype, members[0], tp_groups[members])
            bcast += dst.numel() * dst.element_size() * (rank == members[0]) * (llm.tp - 1)
        grad_dst = grads[torch.from_numpy(dst_k[me])]
        grad_src = island_backward(grad_dst, route, len(src_k[me]), edge, counter)
        out.append((dst.numpy(), grad_src.numpy()))
    return dict(out=out, bytes=(counter.forward, counter.backward, bcast))


CASES = {
    # name: (encoder layout, LLM layout, samples, micro-batches, leader)
    "enc_dp2_to_llm_tp2": (Layout(dp=2), Layout(tp=2), 6, 3, False),
    "enc_dp2_to_llm_tp2_leader": (Layout(dp=2), Layout(tp=2), 6, 3, True),
    "dp_equal": (Layout(dp=2), Layout(dp=2), 8, 2, False),
    "fan_in": (Layout(dp=4), Layout(dp=2), 8, 3, False),
    "fan_out_src_tp2": (Layout(tp=2), Layout(dp=2), 6, 3, False),
    "src_cp2_dst_cp2": (Layout(cp=2, dp=2), Layout(cp=2), 8, 3, False),
    "src_pp2_dst_cp2_pp2": (Layout(pp=2), Layout(cp=2, pp=2), 6, 3, False),
    "dst_tp2_cp2_leader": (Layout(dp=2), Layout(tp=2, cp=2), 6, 2, True),
}


@pytest.mark.parametrize("name", CASES)
def test_island_route_moves_rows_bit_for_bit(name):
    enc, llm, num_samples, num_micro, leader = CASES[name]
    res = run_ranks(_worker, enc.size + llm.size, enc, llm, num_samples, num_micro, leader,
                    timeout=60)
    batch = random_batch(num_samples, seed=num_samples + 3 * enc.cp + llm.cp)
    ranks, micro = island_keys(batch, enc, llm, num_micro, leader)
    values, grads = _values(int(batch.offset[-1]), 1), _values(int(batch.offset[-1]), 2)
    assert all(res[r] is None for r in range(enc.size + llm.size) if r not in ranks)
    moved_rows = 0
    for i, (src_k, dst_k, owner, full) in enumerate(micro):
        for j, g in enumerate(ranks):
            dst, _ = res[g]["out"][i]
            assert np.array_equal(dst, values[full[j]].numpy()), (name, i, g)
            moved_rows += len(full[j])
        # encoder TP replicas hold the same keys: their returned gradients sum to the whole one
        for j, g in enumerate(ranks):
            if g < enc.size and enc.coords(g)[0] == 0:
                total = sum(res[ranks[j + t]]["out"][i][1] for t in range(enc.tp))
                assert np.array_equal(total, grads[src_k[j]].numpy()), (name, i, g)
    assert moved_rows > 0
    # bytes: direct = every destination rank's rows once; leader = once per TP group (the
    # minimum) plus the broadcast; backward = once per destination shard in both
    fwd, bwd, bcast = (sum(res[g]["bytes"][k] for g in ranks) for k in range(3))
    shards = [j if g < enc.size else (g - enc.size) // llm.tp for j, g in enumerate(ranks)]
    need_fwd = sum(min_route_rows(m[3])[0] for m in micro)
    need_shard = sum(min_route_rows(m[3], shards)[1] for m in micro)
    assert bwd == need_shard * H * 4
    assert fwd == (need_shard if leader else need_fwd) * H * 4
    assert bcast == (need_fwd - need_shard if leader else 0) * H * 4


def test_edge_ranks_are_last_stage_then_first_stage():
    enc, llm = Grid(tp=1, cp=2, dp=1, pp=2), Grid(tp=2, cp=1, dp=1, pp=2, rank_offset=4)
    assert edge_ranks(enc, llm) == (2, 3, 4, 5)
    with pytest.raises(ValueError, match="share rank 3"):
        edge_ranks(enc, Grid(tp=2, cp=1, dp=1, pp=1, rank_offset=3))


def test_island_micro_batches_follow_the_llm_order():
    # fan-in: LLM micro-batches [0, 1], [2, 3], [4, 5]; encoder lane 1 holds samples 3..5
    assert island_micro_batches([3, 4, 5], [[0, 1], [2, 3], [4, 5]]) == [[], [3], [4, 5]]
    # the LLM order, not the lane's
    assert island_micro_batches([0, 1, 2], [[2, 0], [1]]) == [[2, 0], [1]]
    with pytest.raises(ValueError, match="never consumed: \\[2\\]"):
        island_micro_batches([0, 1, 2], [[0], [1]])


def test_island_forward_rejects_a_route_past_the_source():
    route = build_routes([np.arange(3), EMPTY], [EMPTY, np.arange(3)])[0]
    with pytest.raises(ValueError, match="sends row 2"):
        island_forward(torch.zeros(2, H), route, IslandEdge((0, 1), 0))
