"""The rehearsal's memory measurement (hcp/preflight/rehearse/runner.py): what it tracks is what a
real run holds, not what its own instruments keep alive."""
from __future__ import annotations

import contextlib
import gc
import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hcp.preflight.rehearse.count import flop_counter
from hcp.preflight.rehearse.runner import _totals_only


class _Saves(torch.autograd.Function):
    """x -> 2x, saving x; records each call's context (weakly) and whether it ran in backward."""

    calls: list = []

    @staticmethod
    def forward(ctx, x):
        _Saves.calls.append((weakref.ref(ctx), torch._C._current_graph_task_id() != -1))
        ctx.save_for_backward(x)
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors
        return 2 * grad


def test_flop_counter_keeps_no_recomputed_graph_alive():
    """Full recompute under the rehearsal's FLOP counter: once backward is done, the re-run
    forward's graph (and the tensors it saved, e.g. all-gathered CP K/V) is gone, as in a real
    run. torch's own module tracking would keep it until the counter exits: its hook on the second
    layer's output (made inside the re-run, which goes on to the third layer's saves) closes a
    cycle through C++ (seconds: torch imports)."""
    torch.manual_seed(0)
    first, second, third = (nn.Linear(8, 8) for _ in range(3))
    x = torch.randn(4, 8, requires_grad=True)
    totals = []
    for counter in (_totals_only(flop_counter()), flop_counter()):  # the second: torch's, for its total
        _Saves.calls.clear()
        with counter:  # the rehearsal's optimizer step and peak come before the counter exits
            checkpoint(lambda t: third(second(_Saves.apply(first(t)))), x, use_reentrant=False).sum().backward()
            gc.collect()
            recomputed = [ref for ref, in_backward in _Saves.calls if in_backward]
            assert len(recomputed) == 1
            if not totals:
                assert recomputed[0]() is None
        totals.append(counter.get_total_flops())
    assert totals[0] == totals[1] > 0  # the FLOPs counted are the same


def test_flop_counter_runs_the_ops_training_runs():
    """SwiGLU's backward under the rehearsal's FLOP counter allocates what it allocates without
    it: `FlopCounterMode` would run `silu_backward` as its decomposition, whose temporaries
    raise the tracked peak (`hcp.preflight.rehearse.count.UNDECOMPOSED`)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    x = torch.randn(256, 512, requires_grad=True)
    peaks = []
    for counter in (None, flop_counter()):
        with MemTracker() as tracker, counter if counter is not None else contextlib.nullcontext():
            (torch.nn.functional.silu(x) * x).sum().backward()
        peaks.append(sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values()))
        x.grad = None
    assert peaks[0] == peaks[1] > 0


def test_rehearsal_tracks_the_steady_state_that_plan_mode_estimates(tmp_path):
    """Two steps of one rank (llama_tiny at width 1024, in-process: seconds). Adam allocates its
    moments in the first step and a real run holds them through every later step; the
    rehearsal allocates them beforehand, so its first step's peak is already the steady state's:
    step 2's peak (where the FLOP counter runs) equals step 1's but for the previous step's
    world figures still in flight (bytes), here during the backward
    (activations and temporaries alive) with both moments, 8 B per trained fp32 parameter, held.
    Plan mode's estimate of the step is within 20% of step 2's peak."""
    from hcp.config.layouts import resolve_layouts, world_size_of
    from hcp.data.build import prepare_data
    from hcp.preflight.memory import GIB
    from hcp.preflight.plan_mode import memory_per_rank
    from hcp.preflight.rehearse.runner import rehearsal_config, rehearse_rank
    from tests.cfg_utils import compose_cfg, with_specs

    cfg = compose_cfg(["mode=rehearse", "logger=none", "+recipe=llama_tiny", "trainer.global_batch_size=8",
                       "trainer.micro_batch_tokens=4096", "llm.hidden_size=1024", "llm.ffn_hidden_size=2816",
                       "llm.num_heads=8", "llm.num_kv_heads=8"], run_dir=str(tmp_path))
    list(prepare_data(*with_specs(cfg)))
    world = world_size_of(cfg, 1)
    res = rehearse_rank(rehearsal_config(cfg), str(tmp_path), 0, world, 2)
    assert res.error is None, res.error
    # step 2 also holds step 1's world figures in flight (hcp.train.throughput.WorldStats: its own
    # row and the gathered rows, world + 1 rows of 5 float64 each: peak memory, bubble fraction,
    # preemption flag, busy seconds, data-wait seconds)
    in_flight = (world + 1) * 5 * 8
    assert len(res.step_peaks) == 2 and res.step_peaks[1] == res.step_peaks[0] + in_flight == res.peak_bytes
    cats = res.peak_categories
    assert cats["Activation"] + cats["Temp"] > res.param_bytes  # the peak is in the backward
    assert cats["Optstate"] >= 2 * res.param_bytes  # with both Adam moments
    plan = memory_per_rank(cfg, resolve_layouts(cfg, world), world, micro_batches=max(res.step_worth))
    assert abs(plan[0]["total"] * GIB / res.step_peaks[1] - 1) <= 0.2, (plan[0], res.step_peaks)
