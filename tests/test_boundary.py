"""Colocated boundary communicator (docs/design.md 4.2, 4.3): rows move bit for bit forward and
backward on forked gloo ranks, for every batch transform, and the bytes moved equal the minimum.
The routing tables come from `build_routes` (benchmarks/route_keys.py) over hand-built keys
(tests/route_utils.py)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hcp.comm.boundary import RouteBytes, route_rows
from dist_utils import run_ranks
from route_utils import Layout, build_routes, image_route, min_route_rows, random_batch

H = 6


def _global(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(seed))


def _route_worker(rank, world, enc, llm, num_samples, num_micro):
    batch = random_batch(num_samples, seed=num_samples + llm.cp)
    inputs = image_route(batch, enc, llm, num_micro)
    route = build_routes(inputs.src_keys, inputs.dst_keys, inputs.grad_owner, ranks=[rank])[rank]
    rows = int(batch.offset[-1])
    values, grads = _global(rows, 1), _global(rows, 2)
    src_keys = torch.from_numpy(inputs.src_keys[rank])
    dst_keys = torch.from_numpy(inputs.dst_keys[rank])
    src = values[src_keys].clone().requires_grad_()
    counter = RouteBytes()
    dst = route_rows(src, route, None, counter)
    fwd_exact = torch.equal(dst, values[dst_keys])
    # every row's gradient depends only on its key: TP replicas of a destination hold equal ones
    dst.backward(grads[dst_keys])
    # encoder TP replicas each got the gradient of the rows they sent; the sum is the whole one
    grad_sum = src.grad.clone()
    tp_groups = [dist.new_group(list(range(g, g + enc.tp))) for g in range(0, world, enc.tp)]
    dist.all_reduce(grad_sum, group=tp_groups[rank // enc.tp])
    sent_rows = torch.tensor([int((src.grad != 0).any(1).sum()), len(src_keys)])
    moved = torch.tensor([counter.forward, counter.backward])
    dist.all_reduce(moved)
    return dict(fwd=fwd_exact, bwd=torch.equal(grad_sum, grads[src_keys]),
                sent_rows=sent_rows.tolist(), moved=moved.tolist(),
                minimum=[m * H * 4 for m in min_route_rows(inputs.dst_keys, inputs.dst_shard)],
                received=len(dst_keys))


CASES = {
    # name: (encoder layout, LLM layout, samples, micro-batches per lane)
    "dp_equal": (Layout(dp=4), Layout(dp=4), 8, 2),
    "fan_in_dst_tp2": (Layout(dp=4), Layout(tp=2, dp=2), 8, 2),
    "fan_out_src_tp2": (Layout(tp=2, dp=2), Layout(dp=4), 8, 2),
    "dst_cp2": (Layout(dp=4), Layout(cp=2, dp=2), 8, 2),
    "dst_cp4": (Layout(tp=2, dp=2), Layout(cp=4), 6, 3),
    "dst_pp2": (Layout(dp=4), Layout(dp=2, pp=2), 8, 2),
    "dst_tp2_cp2_pp2": (Layout(tp=2, dp=4), Layout(tp=2, cp=2, pp=2), 8, 2),
}


@pytest.mark.parametrize("name", CASES)
def test_route_moves_rows_bit_for_bit(name):
    enc, llm, num_samples, num_micro = CASES[name]
    out = run_ranks(_route_worker, llm.size, enc, llm, num_samples, num_micro, timeout=60)
    assert all(o["fwd"] for o in out), "forward rows differ"
    assert all(o["bwd"] for o in out), "source gradients differ"
    # replicas of one encoder lane send disjoint rows that cover the lane
    for g in range(0, llm.size, enc.tp):
        reps = out[g:g + enc.tp]
        assert sum(o["sent_rows"][0] for o in reps) == reps[0]["sent_rows"][1]
    if enc.tp > 1:
        assert all(o["sent_rows"][0] > 0 for o in out)
    assert out[0]["moved"] == out[0]["minimum"]
    # only the LLM's first stage receives
    first = [r for r in range(llm.size) if llm.coords(r)[3] == 0]
    assert all(out[r]["received"] == 0 for r in range(llm.size) if r not in first)
    assert sum(out[r]["received"] for r in first) > 0


def test_variable_rows_per_sample_occur():
    """The random batch has samples without images, with several, and of different sizes."""
    batch = random_batch(8, seed=9)
    assert 0 in batch.rows and len(set(batch.rows)) >= 4


def test_build_routes_splits_and_grad_ownership():
    """Known value: two source replicas of keys [0..3] split them in halves; a destination TP
    pair both receive key 1, only the owner returns its gradient."""
    routes = build_routes([np.arange(4), np.arange(4)], [np.array([3, 1]), np.array([1])],
                          [np.array([True, True]), np.array([False])])
    assert routes[0].send_index == (1, 1) and routes[0].send_splits == (1, 1)
    assert routes[1].send_index == (3,) and routes[1].send_splits == (1, 0)
    assert routes[0].recv_index == (1, 0) and routes[0].recv_splits == (1, 1)
    assert routes[0].grad_send_splits == (1, 1) and routes[1].grad_send_splits == (0, 0)
    assert routes[0].grad_returns == (True, False) and routes[0].grad_recv_splits == (1, 0)
    assert min_route_rows([np.array([3, 1]), np.array([1])], [0, 0]) == (3, 2)


def test_build_routes_errors():
    with pytest.raises(ValueError, match="needs key 7"):
        build_routes([np.arange(4)], [np.array([7])])
    with pytest.raises(ValueError, match=r"src_keys\[0\] holds key 2 twice"):
        build_routes([np.array([2, 2])], [np.zeros(0)])
    with pytest.raises(ValueError, match="one entry per group rank"):
        build_routes([np.arange(2)], [np.arange(2), np.arange(0)])


@pytest.mark.slow
def test_build_routes_at_cluster_scale():
    """4096 ranks, a global batch of 2048 samples x 576 image rows, encoder tp2 dp2048 -> LLM
    tp8 dp512 (fan-in 4): three ranks' routes in about a second of CPU, rows conserved."""
    world, rows = 4096, 576
    keys = np.arange(2048 * rows, dtype=np.int64).reshape(2048, rows)
    src = [keys[r // 2].ravel() for r in range(world)]
    dst = [keys[(r // 8) * 4:(r // 8) * 4 + 4].ravel() for r in range(world)]
    owner = [np.full(4 * rows, r % 8 == 0) for r in range(world)]
    t0 = time.process_time()  # CPU time: 8 helpers share 2 cores, wall time is noise
    routes = build_routes(src, dst, owner, ranks=[0, 1, 8])
    elapsed = time.process_time() - t0
    assert sum(routes[0].send_splits) + sum(routes[1].send_splits) == 8 * rows
    assert sum(routes[8].recv_splits) == 4 * rows and sum(routes[8].grad_send_splits) == 4 * rows
    assert elapsed < 5.0, elapsed
