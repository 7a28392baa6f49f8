"""The step plan under placement=non_colocated (hcp.plan.step): encoder micro-batches follow the
order the LLM consumes them, and per-micro-batch routes over the edge group (encoder last stage
-> LLM first stage) deliver every image row to the CP shard holding its position, checked
against an independent reference (the merged sequence cut by `cp_shard`), with encoder TP, DP
and PP, LLM TP, CP, DP and PP, and both destination-TP variants (leader, direct)."""
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hcp.parallel.cp_sharding import cp_shard
from hcp.parallel.grid import Grid
from hcp.parallel.islands import edge_ranks
from hcp.plan.island_routes import balanced_lanes
from hcp.plan.step import plan_step
from route_utils import build_routes
from test_step_plan import EDGE, EDGES, encoder_cp_holder, random_sizes, row_ids


def island_layouts(enc, llm):
    """enc = (tp, dp, pp[, cp]) of the vision island on ranks [0, n); llm = (tp, cp, dp, pp) after
    it; the projector shares the vision island with its own (default) sizes."""
    (etp, edp, epp, *ecp), (tp, cp, dp, pp) = enc, llm
    ecp = ecp[0] if ecp else 1
    n = etp * ecp * edp * epp
    return {"vision": NS(module="vision", tp=etp, cp=ecp, pp=epp, dp=edp, rank_offset=0, num_ranks=n,
                         dp_shard=False),
            "projector": NS(module="projector", tp=etp, cp=1, pp=1, dp=edp * epp * ecp, rank_offset=0,
                            num_ranks=n, dp_shard=False),
            "llm": NS(module="llm", tp=tp, cp=cp, pp=pp, dp=dp, rank_offset=n,
                      num_ranks=tp * cp * dp * pp, dp_shard=False)}


def check_island_plan(sizes, lays, mbt, variant="leader"):
    plan = plan_step(sizes, lays, "first_fit", mbt, EDGES, island_route=variant)
    enc, llm = Grid.of(lays["vision"]), Grid.of(lays["llm"])
    world, B, J = enc.size + llm.size, len(sizes), plan.num_micro_batches
    plans = [plan.rank(r) for r in range(world)]
    assert not plan.tables and set(plan.island_tables) == {EDGE}
    # what the LLM consumes in micro-batch j, in packing order
    consumed = [[] for _ in range(J)]
    for r in llm.ranks[0, :, :, 0].ravel():
        for j, mb in enumerate(plans[r].micro_batches):
            if mb.cp_rank == 0:
                consumed[j] += list(mb.samples)
    assert sorted(s for c in consumed for s in c) == list(range(B))            # consumed once
    # every encoder rank of a lane (all stages, TP replicas) encodes the lane's samples, as one
    # micro-batch per LLM micro-batch, in the order micro-batch j consumes them
    lanes = {}
    for r in range(enc.size):
        c = enc.coords(r)
        for m in ("vision", "projector"):
            mbs = plans[r].encoder_micro_batches[m]
            assert len(mbs) == J
            assert sorted(s for mb in mbs for s in mb) == list(plans[r].encoder_samples[m])
            lanes.setdefault(c["dp"], mbs)
            assert mbs == lanes[c["dp"]]
    for j in range(J):
        got = sorted((s for lane in lanes.values() for s in lane[j]), key=consumed[j].index)
        assert got == consumed[j]
    # the lanes share the inputs: after every micro-batch their images so far differ by at most
    # one sample's (`balanced_lanes`)
    done = np.cumsum([[sizes.images[list(mb)].sum() for mb in lanes[d]] for d in sorted(lanes)], 1)
    assert (np.ptp(done, 0) <= sizes.images.max(initial=0)).all()
    assert sorted(s for lane in lanes.values() for mb in lane for s in mb) == list(range(B))
    # per micro-batch: move row ids by the routes, compare with the CP shards' image rows
    ranks = edge_ranks(enc, llm)
    assert plan.island_ranks[EDGE] == ranks
    G = len(ranks)
    ids = row_ids(sizes)
    holder = encoder_cp_holder(sizes, enc.cp)  # encoder CP: a rank sends its chunk of each image
    returned = np.zeros(int(sizes.image_rows.sum()), np.int64)
    for j in range(J):
        routes = [plans[g].island_routes[EDGE][j] for g in ranks]
        src = [np.concatenate([ids[s][ids[s] >= 0] for s in lanes[enc.coords(g)["dp"]][j]] or
                              [np.zeros(0, np.int64)]) if g < enc.size else np.zeros(0, np.int64)
               for g in ranks]
        src = [k[holder[k] == enc.coords(g)["cp"]] if g < enc.size else k for g, k in zip(ranks, src)]
        recv = {d: [] for d in range(G)}
        for e in range(G):
            sent = src[e][list(routes[e].send_index)] if routes[e].send_index else np.zeros(0, np.int64)
            cuts = np.cumsum((0,) + routes[e].send_splits)
            for d in range(G):
                recv[d].append(sent[cuts[d]:cuts[d + 1]])
        wants = []
        for d, g in enumerate(ranks):
            r = routes[d]
            assert tuple(len(p) for p in recv[d]) == r.recv_splits
            dst = np.full(r.dst_rows, -2, np.int64)
            dst[list(r.recv_index)] = np.concatenate(recv[d])
            if g < enc.size:
                assert r.dst_rows == 0
                wants.append(dst)
                continue
            c = llm.coords(g)
            mb = plans[g].micro_batches[j]
            want = []
            if not mb.empty:
                merged = np.concatenate([ids[s] for s in mb.samples])
                shard = cp_shard(torch.as_tensor(mb.cu_seqlens), mb.cp_size, mb.cp_rank)
                local = merged[shard.token_index.numpy()][shard.valid.numpy()]
                want = local[local >= 0].tolist()
            assert mb.image_rows == (0, len(want))
            if variant == "leader" and c["tp"] > 0:
                assert r.dst_rows == 0 and not any(r.send_splits)                # gets it by broadcast
            else:
                assert dst.tolist() == want, f"micro-batch {j}, rank {g}"
            wants.append(dst)
        # gradients: each row returns once, to the rank that sent it
        for e in range(G):
            r = routes[e]
            back = [routes[d].grad_send_splits[e] for d in range(G)]
            assert tuple(back) == r.grad_recv_splits
            idx = np.asarray(r.send_index, np.int64)[np.asarray(r.grad_returns, bool)]
            np.add.at(returned, src[e][idx], 1)
        owner = [np.full(len(w), g >= enc.size and llm.coords(g)["tp"] == 0) for g, w in zip(ranks, wants)]
        assert build_routes(src, wants, owner) == dict(enumerate(routes))
    assert (returned == 1).all()
    # only the edge group holds routes; later LLM stages and earlier encoder stages have none
    assert all(EDGE not in plans[r].island_routes for r in range(world) if r not in ranks)
    return plan, plans


@st.composite
def island_cases(draw):
    enc = tuple(draw(st.sampled_from(v)) for v in ([1, 2], [1, 2, 4], [1, 2, 3]))
    llm = tuple(draw(st.sampled_from(v)) for v in ([1, 2], [1, 2, 4], [1, 2], [1, 2]))
    lanes = int(np.lcm(enc[1], llm[2]))
    return enc, llm, lanes * draw(st.integers(1, 3)), draw(st.integers(0, 2**16)), \
        draw(st.sampled_from(["leader", "direct"]))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(island_cases())
def test_island_plans_encode_in_consumption_order_and_route_rows_to_their_cp_shard(case):
    enc, llm, batch, seed, variant = case
    sizes = random_sizes(np.random.default_rng(seed), batch)
    check_island_plan(sizes, island_layouts(enc, llm), mbt=48, variant=variant)


def test_balanced_lanes_share_a_skewed_batch_where_blocks_would_not():
    """Four samples of 6 images then four without (one micro-batch): blocks of 4 would give
    lane 0 all 24 inputs; the greedy gives each of 2 lanes 12 (most inputs first, ties to the
    lane with fewer samples, then the lower lane), the same on every call."""
    inputs = np.array([6, 6, 6, 6, 0, 0, 0, 0])
    mb, consume = np.zeros(8, np.int64), np.arange(8)
    lane = balanced_lanes(inputs, mb, consume, 2)
    assert lane.tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert np.bincount(lane, weights=inputs).tolist() == [12, 12]
    # two micro-batches (5, 1 then 3, 3): the second tops up lane 1, behind by 4 after the first
    args = np.array([5, 1, 3, 3]), np.array([0, 0, 1, 1]), np.arange(4), 2
    assert balanced_lanes(*args).tolist() == [0, 1, 1, 1] == balanced_lanes(*args).tolist()


def test_island_sources_are_the_encoder_last_stage_and_the_leader_takes_the_rows():
    """Encoder tp2 dp2 pp2 on ranks 0-7, LLM tp2 cp2 on ranks 8-11: rows leave from ranks 4-7
    (the last encoder stage), only LLM TP rank 0 of each CP rank (ranks 8, 10) receives."""
    sizes = random_sizes(np.random.default_rng(4), 8)
    plan, plans = check_island_plan(sizes, island_layouts((2, 2, 2), (2, 2, 1, 1)), mbt=64)
    senders = {g for j in range(plan.num_micro_batches) for g in range(12)
               if 12 > g and EDGE in plans[g].island_routes and any(plans[g].island_routes[EDGE][j].send_splits)}
    receivers = {g for j in range(plan.num_micro_batches) for g in range(8, 12)
                 if plans[g].island_routes[EDGE][j].dst_rows}
    assert senders <= {4, 5, 6, 7} and senders and receivers == {8, 10}


@pytest.mark.parametrize("enc, llm", [((1, 2, 1, 2), (1, 2, 2, 1)), ((2, 1, 2, 2), (2, 1, 2, 2)),
                                      ((1, 1, 1, 4), (2, 1, 1, 1))])
def test_island_encoder_cp_ranks_each_send_their_chunk(enc, llm):
    """Encoder CP on its island (enc = tp, dp, pp, cp): every CP rank of the last stage sends the
    rows of its chunk of each image (`check_island_plan`), and `encoder_rows` counts them."""
    sizes = random_sizes(np.random.default_rng(1), 8, rows=7)
    plan, plans = check_island_plan(sizes, island_layouts(enc, llm), mbt=64)
    grid, ranks = Grid.of(plan.layouts["vision"]), plan.island_ranks[EDGE]
    last = [r for r in ranks if r < grid.size]
    for r in last:  # its TP replicas split the rows it computed
        peers = [q for q in last if q // grid.tp == r // grid.tp]
        sent = [sum(sum(plans[q].island_routes[EDGE][j].send_splits) for q in peers)
                for j in range(plan.num_micro_batches)]
        assert list(plans[r].encoder_rows["projector"]) == sent
    senders = {grid.coords(r)["cp"] for r in last if any(plans[r].encoder_rows["projector"])}
    assert senders == set(range(grid.cp))


def test_cluster_scale_island_plan_conserves_rows_and_peers_agree():
    """1536 ranks (encoder dp256 x pp2 on 0-511, LLM tp8 x cp2 x dp32 x pp2 after it), global
    batch 2048: every image row is routed once per micro-batch table, a source sends exactly
    its lane's rows of each micro-batch, and sampled peers agree on every count."""
    rng = np.random.default_rng(0)
    sizes = random_sizes(rng, 2048, max_text=1200, rows=64, max_images=3)
    lays = island_layouts((1, 256, 2), (8, 2, 32, 2))
    plan = plan_step(sizes, lays, "first_fit", 2048, EDGES)
    tables, ranks = plan.island_tables[EDGE], plan.island_ranks[EDGE]
    assert len(tables) == plan.num_micro_batches
    assert sum(len(t.src) for t in tables) == int(sizes.image_rows.sum())
    rows = sizes.image_rows
    cache = {}
    rank_plan = lambda r: cache.setdefault(r, plan.rank(int(r)))  # noqa: E731
    for src in rng.choice(256, 6, replace=False) + 256:             # last encoder stage
        p = rank_plan(src)
        for j, (route, mb) in enumerate(zip(p.island_routes[EDGE], p.encoder_micro_batches["vision"])):
            assert sum(route.send_splits) == int(rows[list(mb)].sum())
            for d in np.flatnonzero(route.send_splits)[:4]:
                assert rank_plan(ranks[d]).island_routes[EDGE][j].recv_splits[ranks.index(src)] == \
                    route.send_splits[d]


def _two_encoder_sizes(rng, batch):
    """Sizes of a join + branch batch: each `vision` input is 4 `projector` rows then 1 `pooled`
    row, each `vision2` input 4 `projector2` rows, at random places between text."""
    from hcp.plan.lengths import SampleSizes

    tokens, per = [], {p: [] for p in ("projector", "pooled", "projector2")}
    for _ in range(batch):
        pos, mine = 0, {p: [] for p in per}
        for kind in rng.choice(["vision", "vision2", "text"], int(rng.integers(0, 5))):
            pos += int(rng.integers(0, 6))
            if kind == "vision":
                mine["projector"].append((pos, 4))
                mine["pooled"].append((pos + 4, 1))
                pos += 5
            elif kind == "vision2":
                mine["projector2"].append((pos, 4))
                pos += 4
        tokens.append(pos + 1 + int(rng.integers(0, 6)))
        for p in per:
            per[p].append(mine[p])
    loss = [int(rng.integers(0, t + 1)) for t in tokens]
    return {p: SampleSizes.from_lists(tokens, loss, images) for p, images in per.items()}


def test_two_encoder_islands_plan_each_stream_and_each_lane_inputs_and_rows():
    """A join + branch on islands (vision dp2 on ranks 0-1 with projector and pooled, vision2 on
    rank 2 with projector2, LLM cp2 on ranks 3-4): every island rank's inputs and rows per
    micro-batch (`encoder_inputs`, `encoder_rows`) are what its routes send, and every LLM
    shard's rows per stream (`stream_rows`) what its routes deliver; all rows of each stream
    are sent once."""
    edges = (("vision", "projector"), ("vision", "pooled"), ("projector", "llm"), ("pooled", "llm"),
             ("vision2", "projector2"), ("projector2", "llm"))
    on = lambda m, off, n, **k: NS(module=m, tp=1, cp=k.get("cp", 1), pp=1, dp=k.get("dp", n),  # noqa: E731
                                   rank_offset=off, num_ranks=n, dp_shard=False)
    lays = {"vision": on("vision", 0, 2), "projector": on("projector", 0, 2), "pooled": on("pooled", 0, 2),
            "vision2": on("vision2", 2, 1), "projector2": on("projector2", 2, 1), "llm": on("llm", 3, 2, cp=2, dp=1)}
    streams = _two_encoder_sizes(np.random.default_rng(3), 8)
    plan = plan_step(streams["projector"], lays, "first_fit", 24, edges, stream_sizes=streams)
    assert plan.num_micro_batches > 1 and not plan.tables
    plans = [plan.rank(r) for r in range(5)]
    sent = {p: 0 for p in streams}
    for r, heads in ((0, "vision"), (1, "vision"), (2, "vision2")):
        mine = plans[r]
        for j, mb in enumerate(mine.encoder_micro_batches[heads]):
            images = streams["projector" if heads == "vision" else "projector2"].images
            assert mine.encoder_inputs[heads][j] == int(images[list(mb)].sum())
            for p in (("projector", "pooled") if heads == "vision" else ("projector2",)):
                route = mine.island_routes[(p, "llm")][j]
                assert mine.encoder_rows[p][j] == sum(route.send_splits) == int(streams[p].image_rows[list(mb)].sum())
                sent[p] += mine.encoder_rows[p][j]
    assert sent == plan.counts.stream_rows == {p: int(s.image_rows.sum()) for p, s in streams.items()}
    for r in (3, 4):
        for j, mb in enumerate(plans[r].micro_batches):
            for p in streams:
                assert mb.stream_rows[p] == (0, plans[r].island_routes[(p, "llm")][j].dst_rows)
