"""The step plan (hcp.plan): packing, lanes, routing tables and counts, at cluster scale without
processes. Routed rows are checked against an independent reference: the merged sequence of each
micro-batch cut by `hcp.parallel.cp_sharding.cp_shard` (the model's own CP sharding)."""
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hcp.data.packing import first_fit
from hcp.parallel.cp_sharding import cp_shard
from hcp.parallel.grid import Grid
from hcp.plan.lengths import SampleSizes
from hcp.plan.step import plan_step
from route_utils import build_routes

EDGES = (("vision", "projector"), ("projector", "llm"))
EDGE = ("projector", "llm")


def lay(m, tp=1, cp=1, dp=1, pp=1):
    return NS(module=m, tp=tp, cp=cp, pp=pp, dp=dp, rank_offset=0, num_ranks=tp * cp * pp * dp,
              dp_shard=False)


def layouts(enc_tp, enc_dp, tp, cp, dp, pp=1, enc_cp=1):
    assert enc_tp * enc_cp * enc_dp == tp * cp * dp * pp
    return {"vision": lay("vision", enc_tp, enc_cp, dp=enc_dp),
            "projector": lay("projector", enc_tp, enc_cp, dp=enc_dp), "llm": lay("llm", tp, cp, dp, pp)}


def encoder_cp_holder(sizes, cp):
    """[rows] the encoder CP rank holding each global row key: the one whose chunk of the image's
    CLS + rows positions (`encoder_cp.positions`) holds the row's position."""
    from hcp.parallel.encoder_cp import positions

    out = []
    for n in sizes.image_rows_each.tolist():
        holder = np.empty(n + 1, np.int64)
        for r in range(cp):
            pos = positions(n + 1, cp, r)
            holder[pos[pos <= n]] = r
        out.append(holder[1:])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def random_sizes(rng, batch, max_text=40, rows=4, max_images=3):
    tokens, images = [], []
    for _ in range(batch):
        n_img = int(rng.integers(0, max_images + 1))
        gaps = rng.integers(0, max_text // (n_img + 1) + 1, n_img + 1) + np.r_[np.zeros(n_img, int), 1]
        per, pos = [], 0
        for k in range(n_img):
            pos += int(gaps[k])
            per.append((pos, rows))
            pos += rows
        tokens.append(pos + int(gaps[-1]))
        images.append(per)
    loss = [int(rng.integers(0, t + 1)) for t in tokens]
    return SampleSizes.from_lists(tokens, loss, images)


def row_ids(sizes):
    """Merged-sequence row ids per sample: -1 on text, the global row key on image tokens."""
    out, nxt = [], 0
    for s in range(len(sizes)):
        ids = np.full(int(sizes.tokens[s]), -1, dtype=np.int64)
        for k in range(sizes.image_offsets[s], sizes.image_offsets[s + 1]):
            a, n = int(sizes.image_starts[k]), int(sizes.image_rows_each[k])
            ids[a:a + n] = np.arange(nxt, nxt + n)
            nxt += n
        out.append(ids)
    return out


def exchange(plans, world, sources):
    """Numpy all_to_all_single of every rank's RankRoute: returns each rank's received tensor
    (rows placed by recv_index) and the number of gradient returns each source row gets."""
    recv = {d: [] for d in range(world)}
    for e in range(world):
        r = plans[e].routes[EDGE]
        sent = sources[e][list(r.send_index)] if r.send_index else np.zeros(0, np.int64)
        cuts = np.cumsum((0,) + r.send_splits)
        for d in range(world):
            recv[d].append(sent[cuts[d]:cuts[d + 1]])
    out, grads = {}, {e: np.zeros(len(sources[e]), np.int64) for e in range(world)}
    for d in range(world):
        r = plans[d].routes[EDGE]
        parts = recv[d]
        assert tuple(len(p) for p in parts) == r.recv_splits
        flat = np.concatenate(parts)
        dst = np.full(r.dst_rows, -2, np.int64)
        dst[list(r.recv_index)] = flat
        assert (dst != -2).all()
        out[d] = dst
        # backward: owners send their rows' gradients back to the senders
        assert r.grad_send_splits == (r.recv_splits if all(r.grad_owner) else (0,) * world)
    for e in range(world):
        r = plans[e].routes[EDGE]
        back = [plans[d].routes[EDGE].grad_send_splits[e] for d in range(world)]
        assert tuple(back) == r.grad_recv_splits
        idx = np.asarray(r.send_index, np.int64)[np.asarray(r.grad_returns, bool)]
        np.add.at(grads[e], idx, 1)
    return out, grads


def check_plan(sizes, lays, mbt):
    """Every property of one plan, rank by rank."""
    plan = plan_step(sizes, lays, "first_fit", mbt, EDGES)
    llm, enc = Grid.of(lays["llm"]), Grid.of(lays["projector"])
    world = llm.size
    plans = [plan.rank(r) for r in range(world)]
    B = len(sizes)
    # every sample encoded exactly once per encoder module (by one lane; TP replicas and CP
    # ranks, each with its chunk of the tokens, repeat it)
    for m in ("vision", "projector"):
        g = Grid.of(lays[m])
        got = np.concatenate([plans[r].encoder_samples[m] for r in range(world)
                              if g.coords(r)["tp"] == 0 and g.coords(r)["cp"] == 0])
        assert sorted(got.tolist()) == list(range(B))
    # all ranks run the same number of micro-batches; every sample consumed once (one CP group)
    counts = {len(p.micro_batches) for p in plans}
    assert counts == {plan.num_micro_batches}
    consumed = [s for r in range(world) if llm.coords(r)["tp"] == 0 and llm.coords(r)["pp"] == 0
                for mb in plans[r].micro_batches if mb.cp_rank == 0 for s in mb.samples]
    assert sorted(consumed) == list(range(B))
    tokens = sum(int(mb.cu_seqlens[-1]) for r in range(world) if llm.coords(r)["tp"] == 0
                 and llm.coords(r)["pp"] == 0 for mb in plans[r].micro_batches if mb.cp_rank == 0)
    assert tokens == plan.counts.tokens == int(sizes.tokens.sum())
    # every rank of a CP group agrees on the micro-batch; its shard index is its place
    for r in range(world):
        c = llm.coords(r)
        for mb in plans[r].micro_batches:
            assert mb.cp_rank == (c["dp"] * llm.cp + c["cp"]) - mb.cp_block * mb.cp_size
            assert mb.local_tokens == sum(int(sizes.tokens[s]) if mb.cp_size == 1 else
                                       2 * -(-int(sizes.tokens[s]) // (2 * mb.cp_size)) for s in mb.samples)
    # routing: sources hold their lane's rows in sample order; receivers get exactly the image
    # rows of their CP shard in (micro-batch, slot) order, each row's gradient returns once
    ids = row_ids(sizes)
    n = B // enc.dp
    holder = encoder_cp_holder(sizes, enc.cp)  # encoder CP: a rank holds its chunk of each image
    sources = {r: np.concatenate([ids[s][ids[s] >= 0] for s in
                                  range(enc.coords(r)["dp"] * n, (enc.coords(r)["dp"] + 1) * n)])
               for r in range(world)}
    sources = {r: k[holder[k] == enc.coords(r)["cp"]] for r, k in sources.items()}
    got, grads = exchange(plans, world, sources)
    for r in range(world):
        assert (grads[r] <= 1).all()
        c = llm.coords(r)
        if c["pp"] > 0:
            assert got[r].size == 0
            continue
        want = []
        for mb in plans[r].micro_batches:
            start = len(want)
            if not mb.empty:
                merged = np.concatenate([ids[s] for s in mb.samples])
                shard = cp_shard(torch.as_tensor(mb.cu_seqlens), mb.cp_size, mb.cp_rank)
                local = merged[shard.token_index.numpy()][shard.valid.numpy()]
                want += local[local >= 0].tolist()
            assert mb.image_rows == (start, len(want))
        assert got[r].tolist() == want, f"rank {r}"
    # the plan's routes equal the boundary's own builder from the same row keys
    wants = [np.asarray(got[r]) if llm.coords(r)["pp"] == 0 else np.zeros(0, np.int64) for r in range(world)]
    owner = [np.full(len(wants[r]), llm.coords(r)["tp"] == 0) for r in range(world)]
    reference = build_routes([sources[r] for r in range(world)], wants, owner)
    assert all(reference[r] == plans[r].routes[EDGE] for r in range(world))
    returned = np.zeros(int(sizes.image_rows.sum()), np.int64)
    for r in range(world):
        np.add.at(returned, sources[r], grads[r])
    assert (returned == 1).all()
    return plan, plans


@st.composite
def cases(draw):
    tp, cp, pp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2, 4]))
    world = tp * cp * pp * dp
    enc_tp = draw(st.sampled_from([t for t in (1, 2, 4) if world % t == 0]))
    enc_dp = world // enc_tp
    lanes = max(dp, enc_dp)
    batch = lanes * draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    return layouts(enc_tp, enc_dp, tp, cp, dp, pp), batch, seed


@settings(max_examples=40, deadline=None, derandomize=True)
@given(cases())
def test_every_sample_is_encoded_and_consumed_once_and_rows_reach_their_cp_shard(case):
    lays, batch, seed = case
    sizes = random_sizes(np.random.default_rng(seed), batch)
    check_plan(sizes, lays, mbt=48)


@pytest.mark.parametrize("enc, llm, rows", [
    ((1, 2, 2), (1, 2, 2, 1), 4),     # encoder tp1 cp2 dp2 (LLM tp1 cp2 dp2)
    ((2, 2, 2), (2, 1, 2, 2), 7),     # encoder tp2 cp2 dp2 (LLM tp2 dp2 pp2)
    ((1, 4, 1), (1, 1, 4, 1), 4),     # encoder cp4: 5 tokens per image, CP rank 3 holds no row
])
def test_encoder_cp_rows_leave_from_the_cp_rank_holding_them(enc, llm, rows):
    """Colocated encoder CP (enc = tp, cp, dp): every CP rank of a lane sends the rows of its
    chunk of each image (the independent `encoder_cp_holder`), each reaches its LLM CP shard and
    its gradient returns once (`check_plan`)."""
    (etp, ecp, edp), (tp, cp, dp, pp) = enc, llm
    sizes = random_sizes(np.random.default_rng(etp + ecp), 8, rows=rows)
    plan, plans = check_plan(sizes, layouts(etp, edp, tp, cp, dp, pp, enc_cp=ecp), mbt=48)
    senders = {Grid.of(plan.layouts["projector"]).coords(r)["cp"] for r, p in enumerate(plans)
               if any(p.routes[EDGE].send_splits)}
    assert senders == set(range(ecp)) - ({3} if ecp == 4 else set())


def test_first_fit_equals_todays_lane_packing():
    rng = np.random.default_rng(3)
    sizes = random_sizes(rng, 48, max_text=60)
    lays = layouts(1, 8, 2, 2, 2)
    plan, plans = check_plan(sizes, lays, mbt=40)
    for lane in range(2):
        mine = sizes.tokens[lane * 24:(lane + 1) * 24]
        packs = first_fit([-(-int(n) // 4) * 4 for n in mine], 40 * 2)
        rank = Grid.of(lays["llm"]).rank_at(dp=lane)
        got = [list(mb.samples) for mb in plans[rank].micro_batches if not mb.empty]
        assert got == [[lane * 24 + i for i in p] for p in packs]
        assert all(mb.empty for mb in plans[rank].micro_batches[len(packs):])


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_first_fit_packs_every_document_the_cap_allows(cp):
    # a document of max_length(cp, cap) tokens fits one micro-batch on its own, and documents
    # whose per-rank slots fill the cap exactly share one (cp = 1: no padding at all)
    from hcp.config.capacity import max_length, tokens_per_rank
    from hcp.plan.policies import first_fit_policy

    cap = 5
    longest = max_length(cp, cap)
    lens = np.array([longest, 3, cap * cp - 3 if cp == 1 else 2 * cp], dtype=np.int64)
    plan = first_fit_policy(lens, NS(dp=1, cp=cp), cap)
    packs = [g.seq_indices for r in plan.rounds for g in r.groups]
    assert packs[0] == [0]
    assert all(sum(tokens_per_rank(lens[i], cp) for i in p) <= cap for p in packs)
    if cp == 1:
        assert packs == [[0], [1, 2]]


@pytest.mark.parametrize("enc_dp, llm_dp, name", [(4, 4, "DP-equal"), (4, 2, "fan-in"), (2, 4, "fan-out")])
def test_batch_transforms_move_lanes_in_blocks(enc_dp, llm_dp, name):
    """docs/design.md 4.3: destination lane j takes source lanes j*k..j*k+k-1 (fan-in); source lane i
    feeds destination lanes i*k..i*k+k-1 (fan-out); DP-equal is the identity per lane."""
    world = 4
    sizes = SampleSizes.from_lists([10] * 8, [1] * 8, [[(1, 3)], [], [(0, 2), (5, 2)], [(2, 3)]] * 2)
    lays = layouts(world // enc_dp, enc_dp, world // llm_dp, 1, llm_dp)
    plan, plans = check_plan(sizes, lays, mbt=200)
    llm, enc = Grid.of(lays["llm"]), Grid.of(lays["projector"])
    for r in range(world):
        route = plans[r].routes[EDGE]
        senders = {e for e in range(world) if route.recv_splits[e]}
        lanes_in = {enc.coords(e)["dp"] for e in senders}
        lane = llm.coords(r)["dp"]
        if enc_dp >= llm_dp:
            k = enc_dp // llm_dp
            assert lanes_in <= set(range(lane * k, lane * k + k)), name
        else:
            k = llm_dp // enc_dp
            assert lanes_in == {lane // k}, name


def test_encoder_tp_replicas_split_the_rows_to_send():
    sizes = SampleSizes.from_lists([12, 12], [1, 1], [[(0, 4), (6, 3)], [(1, 4)]])
    lays = layouts(2, 2, 1, 4, 1)            # encoder tp2 dp2, LLM cp4
    _, plans = check_plan(sizes, lays, mbt=16)
    sent = [len(plans[r].routes[EDGE].send_index) for r in range(4)]
    assert sent == [4, 3, 2, 2]               # lane 0: 7 rows -> [0, 4) + [4, 7); lane 1: 2 + 2
    assert all(plans[r].routes[EDGE].grad_recv_splits for r in range(4))


def test_llm_pp_and_tp_only_first_stage_receives_and_one_tp_rank_owns_gradients():
    rng = np.random.default_rng(0)
    sizes = random_sizes(rng, 8)
    lays = layouts(1, 8, 2, 2, 1, pp=2)
    _, plans = check_plan(sizes, lays, mbt=64)
    llm = Grid.of(lays["llm"])
    first = [r for r in range(8) if llm.coords(r)["pp"] == 0]
    assert all(plans[r].routes[EDGE].dst_rows == 0 for r in range(8) if r not in first)
    assert sum(plans[r].routes[EDGE].dst_rows for r in first) == 2 * int(sizes.image_rows.sum())
    for r in first:  # both TP ranks get the rows; only tp rank 0 returns their gradient
        route = plans[r].routes[EDGE]
        assert route.dst_rows == plans[r - llm.coords(r)["tp"]].routes[EDGE].dst_rows
        assert set(route.grad_owner) <= {llm.coords(r)["tp"] == 0}


def test_bad_policy_output_and_unknown_policy_are_named():
    sizes = SampleSizes.from_lists([4], [1], [[]])
    with pytest.raises(ValueError, match="packing=.nope"):
        plan_step(sizes, layouts(1, 1, 1, 1, 1), "nope", 8, EDGES)
    with pytest.raises(ValueError, match="encoder-side PP"):
        lays = layouts(1, 1, 1, 1, 1)
        lays["vision"] = lay("vision", cp=1, pp=1, dp=1)
        lays["projector"] = NS(**{**vars(lays["projector"]), "pp": 2})
        plan_step(sizes, lays, "first_fit", 8, EDGES)


CLUSTER = [  # (encoder tp, dp), (LLM tp, cp, dp, pp): thousands of ranks, global batch 2048
    ((1, 1024), (8, 2, 32, 2)),
    ((2, 2048), (8, 2, 128, 2)),
    ((1, 2048), (4, 4, 64, 2)),
    ((4, 1024), (8, 1, 512, 1)),
]


@settings(max_examples=4, deadline=None, derandomize=True)
@given(st.sampled_from(CLUSTER), st.integers(0, 2**16))
def test_cluster_scale_plans_conserve_rows_and_agree_on_micro_batch_counts(case, seed):
    (enc_tp, enc_dp), (tp, cp, dp, pp) = case
    rng = np.random.default_rng(seed)
    sizes = random_sizes(rng, 2048, max_text=1200, rows=64, max_images=3)
    lays = layouts(enc_tp, enc_dp, tp, cp, dp, pp)
    plan = plan_step(sizes, lays, "first_fit", 2048, EDGES)
    world = enc_tp * enc_dp
    packed = np.array([s for g in plan.groups for s in g.seq_indices])
    assert sorted(packed.tolist()) == list(range(2048))                  # consumed once
    assert plan.counts.tokens == int(sizes.tokens[packed].sum())
    table = plan.tables[EDGE]
    assert len(table.src) == int(sizes.image_rows.sum())                  # each row routed once
    assert (table.shard_rows() == plan.image_row_offsets[:, -1]).all()
    picked = rng.choice(world, 24, replace=False)
    cache = {}
    route = lambda r: cache.setdefault(r, plan.rank(int(r)))  # noqa: E731
    for d in picked:
        p = route(d)
        assert len(p.micro_batches) == plan.num_micro_batches
        r = p.routes[EDGE]
        for e in np.flatnonzero(r.recv_splits)[:8]:                       # peers agree on counts
            assert route(e).routes[EDGE].send_splits[d] == r.recv_splits[e]
        assert sum(r.recv_splits) == r.dst_rows == sum(mb.image_rows[1] - mb.image_rows[0]
                                                       for mb in p.micro_batches)
        assert sorted(r.recv_index) == list(range(r.dst_rows))


def _checksum(order=None):
    sizes = random_sizes(np.random.default_rng(1), 16)
    if order is not None:
        sizes = sizes.take(order)
    plan = plan_step(sizes, layouts(1, 8, 2, 2, 2), "first_fit", 48, EDGES)
    assert plan.rank(3, checksum=True).checksum == plan.checksum()  # what plan_check compares
    return plan.checksum()


def test_ranks_in_other_processes_derive_the_same_plan_and_another_batch_another_checksum():
    """Ranks are separate interpreters: a plan that depended on string hashing (set or dict
    order of names), object ids or unseeded randomness would differ between them and hang a
    collective. A fresh interpreter with another hash seed plans what this one plans."""
    import os
    import subprocess
    import sys

    here = _checksum()
    code = "import test_step_plan as t; print(t._checksum())"
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONHASHSEED": "12345"},
                         capture_output=True, text=True, check=True, timeout=120)
    assert int(out.stdout.split()[-1]) == here
    assert _checksum(list(range(1, 16)) + [0]) != here
