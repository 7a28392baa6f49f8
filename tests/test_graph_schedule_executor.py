"""The graph-aware 1F1B executed on forked gloo ranks (docs/design.md 4.4) reproduces the
single-process gradients (rtol 1e-5): a join of two encoder islands into an LLM island with pp2,
an encoder dp2 island into an LLM tp2 island (direct and leader + broadcast routes), and a
branch of one encoder into an LLM and a deeper two-stage head.

Join: vision encoder dp2 on ranks 0-1 (fan-in into the LLM's one lane, variable image rows per
sample, some samples without images), an audio encoder with pp2 on ranks 2-3 (rows leave
from its last stage), the LLM with pp2 on ranks 4-5. Tiny linear modules:
vision rows = Wv x; audio rows = Wa2 tanh(Wa1 a); LLM stage 0: h = tanh(W1 [vision; audio]);
stage 1: loss = sum((W2 h)^2) / total rows of the step.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
# autograd.backward(out, grad) imports this lazily (seconds per forked rank on a loaded machine):
# import it once here, before the ranks fork
import torch.fx.experimental.symbolic_shapes  # noqa: F401

from hcp.comm.island import IslandEdge
from hcp.parallel.grid import Grid
from hcp.parallel.islands import edge_ranks
from hcp.schedule.graph import graph_one_f_one_b, stage_graph
from hcp.schedule.executor import Executor
from hcp.schedule.links import PipeLink, RouteLink
from dist_utils import run_ranks
from route_utils import build_routes, island_micro_batches, lane, micro_batches, random_batch

D, H, SAMPLES = 3, 4, 6
GRAPH = stage_graph({"vision": 1, "audio": 2, "llm": 2}, [["vision", "llm"], ["audio", "llm"]])
STAGE_OF_RANK = [0, 0, 1, 2, 3, 4]
VISION, AUDIO, LLM = Grid(1, 1, 2, 1, 0), Grid(1, 1, 1, 2, 2), Grid(1, 1, 1, 2, 4)


def _setup(num_micro):
    batch = random_batch(SAMPLES, seed=5)
    audio_rows = [s % 3 + 1 for s in range(SAMPLES)]
    a_off = np.concatenate([[0], np.cumsum(audio_rows)]).astype(np.int64)
    gen = torch.Generator().manual_seed(0)
    data = dict(x=torch.randn(int(batch.offset[-1]), D, generator=gen),
                a=torch.randn(int(a_off[-1]), D, generator=gen))
    weights = {name: torch.randn(shape, generator=gen) * 0.5 for name, shape in
               [("Wv", (H, D)), ("Wa1", (H, D)), ("Wa2", (H, H)), ("W1", (H, H)), ("W2", (1, H))]}
    mbs = micro_batches(list(range(SAMPLES)), num_micro)
    a_keys = [np.concatenate([np.arange(a_off[s], a_off[s + 1]) for s in mb]).astype(np.int64)
              if mb else np.zeros(0, np.int64) for mb in mbs]
    return batch, data, weights, mbs, a_keys


def _reference(num_micro):
    batch, data, w, mbs, a_keys = _setup(num_micro)
    w = {k: v.clone().requires_grad_() for k, v in w.items()}
    total = int(batch.offset[-1]) + sum(len(k) for k in a_keys)
    for mb, ak in zip(mbs, a_keys):
        v = data["x"][torch.from_numpy(batch.keys(mb))] @ w["Wv"].T
        a = torch.tanh(data["a"][torch.from_numpy(ak)] @ w["Wa1"].T) @ w["Wa2"].T
        h = torch.tanh(torch.cat([v, a]) @ w["W1"].T)
        ((h @ w["W2"].T) ** 2).sum().div(total).backward()
    return {k: v.grad for k, v in w.items()}


def _worker(rank, world, num_micro):
    batch, data, w, mbs, a_keys = _setup(num_micro)
    w = {k: v.clone().requires_grad_() for k, v in w.items()}
    total = int(batch.offset[-1]) + sum(len(k) for k in a_keys)
    n_v = [len(batch.keys(mb)) for mb in mbs]
    v_ranks, a_ranks = edge_ranks(VISION, LLM), edge_ranks(AUDIO, LLM)      # (0, 1, 4), (3, 4)
    empty = np.zeros(0, np.int64)
    # per micro-batch routes: vision lane e sends its samples of micro-batch i, rank 4 needs all
    lanes = [island_micro_batches(lane(SAMPLES, 2, e), mbs) for e in range(2)]
    v_src = [[batch.keys(lanes[e][i]) for e in range(2)] for i in range(len(mbs))]
    v_routes = [build_routes(src + [empty], [empty, empty, batch.keys(mb)])
                for src, mb in zip(v_src, mbs)]
    a_routes = [build_routes([k, empty], [empty, k]) for k in a_keys]
    stage = STAGE_OF_RANK[rank]
    spec_a = lambda i: ((len(a_keys[i]), H), torch.float32)                 # noqa: E731
    spec_h = lambda i: ((n_v[i] + len(a_keys[i]), H), torch.float32)       # noqa: E731
    g = GRAPH.index
    if rank in (0, 1):
        edge = IslandEdge(v_ranks, rank)
        links = {g("llm", 0): RouteLink(edge, [r[rank] for r in v_routes], H, torch.float32)}

        def forward(i, inputs):
            return data["x"][torch.from_numpy(v_src[i][rank])] @ w["Wv"].T
    elif rank == 2:
        links = {g("audio", 1): PipeLink(3, spec_a)}

        def forward(i, inputs):
            return torch.tanh(data["a"][torch.from_numpy(a_keys[i])] @ w["Wa1"].T)
    elif rank == 3:
        links = {g("audio", 0): PipeLink(2, spec_a),
                 g("llm", 0): RouteLink(IslandEdge(a_ranks, 0), [r[0] for r in a_routes], H, torch.float32)}

        def forward(i, inputs):
            return inputs[g("audio", 0)] @ w["Wa2"].T
    elif rank == 4:
        links = {g("vision", 0): RouteLink(IslandEdge(v_ranks, 2), [r[2] for r in v_routes], H, torch.float32),
                 g("audio", 1): RouteLink(IslandEdge(a_ranks, 1), [r[1] for r in a_routes], H, torch.float32),
                 g("llm", 1): PipeLink(5, spec_h)}

        def forward(i, inputs):
            return torch.tanh(torch.cat([inputs[g("vision", 0)], inputs[g("audio", 1)]]) @ w["W1"].T)
    else:
        links = {g("llm", 0): PipeLink(4, spec_h)}

        def forward(i, inputs):
            return ((inputs[g("llm", 0)] @ w["W2"].T) ** 2).sum() / total

    Executor(forward, links).run(graph_one_f_one_b(GRAPH, num_micro)[stage])
    grads = {k: (v.grad if v.grad is not None else torch.zeros_like(v)) for k, v in w.items()}
    vision_dp = dist.new_group([0, 1])
    if rank in (0, 1):
        dist.all_reduce(grads["Wv"], group=vision_dp)  # vision DP: sum of the lanes
    return grads


@pytest.mark.parametrize("num_micro", [1, 4])
def test_join_of_two_encoder_islands_into_an_llm_with_pp2_matches_the_reference(num_micro):
    ref = _reference(num_micro)
    res = run_ranks(_worker, 6, num_micro, timeout=60)
    owner = {"Wv": 0, "Wa1": 2, "Wa2": 3, "W1": 4, "W2": 5}
    for name, rank in owner.items():
        assert ref[name].abs().sum() > 0
        torch.testing.assert_close(res[rank][name], ref[name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res[1]["Wv"], ref["Wv"], rtol=1e-5, atol=1e-6)


def _tp_reference(num_micro):
    batch, data, w, mbs, _ = _setup(num_micro)
    w = {k: w[k].clone().requires_grad_() for k in ("Wv", "W1", "W2")}
    for mb in mbs:
        v = data["x"][torch.from_numpy(batch.keys(mb))] @ w["Wv"].T
        ((torch.tanh(v @ w["W1"].T) @ w["W2"].T) ** 2).sum().div(int(batch.offset[-1])).backward()
    return {k: v.grad for k, v in w.items()}


def _tp_worker(rank, world, num_micro, leader):
    """Vision dp2 on ranks 0-1 -> an LLM stage on ranks 2-3 whose two TP ranks hold replicated
    weights (each computes the whole loss, as TP ranks see the same rows); only TP rank 0
    returns the rows' gradient, so the encoder's gradient is not doubled."""
    batch, data, w, mbs, _ = _setup(num_micro)
    w = {k: w[k].clone().requires_grad_() for k in ("Wv", "W1", "W2")}
    total = int(batch.offset[-1])
    ranks = edge_ranks(VISION, Grid(2, 1, 1, 1, 2))                       # (0, 1, 2, 3)
    empty = np.zeros(0, np.int64)
    lanes = [island_micro_batches(lane(SAMPLES, 2, e), mbs) for e in range(2)]
    v_src = [[batch.keys(lanes[e][i]) for e in range(2)] for i in range(len(mbs))]
    routes = [build_routes(src + [empty, empty],
                           [empty, empty, batch.keys(mb), empty if leader else batch.keys(mb)],
                           [empty, empty, np.ones(len(batch.keys(mb)), bool),
                            np.zeros(0 if leader else len(batch.keys(mb)), bool)])
              for src, mb in zip(v_src, mbs)]
    tp_group = dist.new_group([2, 3])
    graph = stage_graph({"vision": 1, "llm": 1}, [["vision", "llm"]])
    edge = IslandEdge(ranks, rank)
    if rank < 2:
        link = RouteLink(edge, [r[rank] for r in routes], H, torch.float32)

        def forward(i, inputs):
            return data["x"][torch.from_numpy(v_src[i][rank])] @ w["Wv"].T
    else:
        bcast = (tp_group, 2, [len(batch.keys(mb)) for mb in mbs]) if leader else None
        link = RouteLink(edge, [r[rank] for r in routes], H, torch.float32, leader=bcast)

        def forward(i, inputs):
            return ((torch.tanh(inputs[0] @ w["W1"].T) @ w["W2"].T) ** 2).sum() / total
    stage = 0 if rank < 2 else 1
    Executor(forward, {1 - stage: link}).run(graph_one_f_one_b(graph, num_micro)[stage])
    grads = {k: (v.grad if v.grad is not None else torch.zeros_like(v)) for k, v in w.items()}
    vision_dp = dist.new_group([0, 1])
    if rank < 2:
        dist.all_reduce(grads["Wv"], group=vision_dp)
    return grads


@pytest.mark.parametrize("leader", [False, True], ids=["direct", "leader"])
def test_encoder_dp2_island_into_llm_tp2_island_matches_the_reference(leader):
    ref = _tp_reference(3)
    res = run_ranks(_tp_worker, 4, 3, leader, timeout=60)
    for rank in (0, 1):
        torch.testing.assert_close(res[rank]["Wv"], ref["Wv"], rtol=1e-5, atol=1e-6)
    for rank in (2, 3):
        for name in ("W1", "W2"):
            torch.testing.assert_close(res[rank][name], ref[name], rtol=1e-5, atol=1e-6)


def _branch_setup(num_micro):
    batch, data, w, mbs, _ = _setup(num_micro)
    return batch, data, {k: w[k].clone().requires_grad_() for k in ("Wv", "W1", "Wa2", "W2")}, mbs


def _branch_losses(v, w, total):
    """The LLM's loss and the head's two stages: (sum (W1 v)^2, sum W2 tanh(Wa2 v)) / total."""
    h = torch.tanh(v @ w["Wa2"].T)
    return ((v @ w["W1"].T) ** 2).sum() / total, (h @ w["W2"].T).sum() / total


def _branch_worker(rank, world, num_micro):
    """vision (rank 0) feeds the LLM (rank 1, one stage, a sink) and a head with pp2 (ranks
    2-3): a branch into consumers of different depths."""
    batch, data, w, mbs = _branch_setup(num_micro)
    total = int(batch.offset[-1])
    graph = stage_graph({"vision": 1, "llm": 1, "head": 2}, [["vision", "llm"], ["vision", "head"]])
    empty = np.zeros(0, np.int64)
    keys = [batch.keys(mb) for mb in mbs]
    to_llm = [build_routes([k, empty], [empty, k]) for k in keys]
    to_head = [build_routes([k, empty], [empty, k]) for k in keys]
    spec = lambda i: ((len(keys[i]), H), torch.float32)                    # noqa: E731
    g = graph.index
    if rank == 0:
        links = {g("llm", 0): RouteLink(IslandEdge((0, 1), 0), [r[0] for r in to_llm], H, torch.float32),
                 g("head", 0): RouteLink(IslandEdge((0, 2), 0), [r[0] for r in to_head], H, torch.float32)}

        def forward(i, inputs):
            return data["x"][torch.from_numpy(keys[i])] @ w["Wv"].T
    elif rank == 1:
        links = {g("vision", 0): RouteLink(IslandEdge((0, 1), 1), [r[1] for r in to_llm], H, torch.float32)}

        def forward(i, inputs):
            return ((inputs[g("vision", 0)] @ w["W1"].T) ** 2).sum() / total
    elif rank == 2:
        links = {g("vision", 0): RouteLink(IslandEdge((0, 2), 1), [r[1] for r in to_head], H, torch.float32),
                 g("head", 1): PipeLink(3, spec)}

        def forward(i, inputs):
            return torch.tanh(inputs[g("vision", 0)] @ w["Wa2"].T)
    else:
        links = {g("head", 0): PipeLink(2, spec)}

        def forward(i, inputs):
            return (inputs[g("head", 0)] @ w["W2"].T).sum() / total
    stage = [g("vision", 0), g("llm", 0), g("head", 0), g("head", 1)][rank]
    Executor(forward, links).run(graph_one_f_one_b(graph, num_micro)[stage])
    return {k: (v.grad if v.grad is not None else torch.zeros_like(v)) for k, v in w.items()}


def test_branch_into_an_llm_and_a_deeper_head_matches_the_reference():
    batch, data, w, mbs = _branch_setup(3)
    for mb in mbs:
        v = data["x"][torch.from_numpy(batch.keys(mb))] @ w["Wv"].T
        sum(_branch_losses(v, w, int(batch.offset[-1]))).backward()
    res = run_ranks(_branch_worker, 4, 3, timeout=60)
    for name, rank in {"Wv": 0, "W1": 1, "Wa2": 2, "W2": 3}.items():
        assert w[name].grad.abs().sum() > 0
        torch.testing.assert_close(res[rank][name], w[name].grad, rtol=1e-5, atol=1e-6)
