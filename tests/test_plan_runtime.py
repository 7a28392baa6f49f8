"""The step plan decides the runtime's per-step policy (issue 28): whether a rank runs its empty
micro-batches (`keep_empty`) and whether the gradient reduction may start inside the last
backward (`overlap_grad_sync`), so the trainer decides neither. Pure: no process group."""
from types import SimpleNamespace as NS

import numpy as np
import pytest

from hcp.config.compose import compose_config
from hcp.dcp.policy import dynamic_cp_policy
from hcp.plan.lengths import SampleSizes
from hcp.plan.step import plan_step, register_policy
from test_island_plan import island_layouts
from test_step_plan import EDGES, layouts, random_sizes

CFG = compose_config(["+recipe=llama_tiny"])


def _llm(dp=1, pp=1, dp_shard=False):
    layers = CFG.llm.num_layers
    return NS(module="llm", tp=1, cp=1, pp=pp, dp=dp, rank_offset=0, num_ranks=dp * pp,
              pp_layers=(layers // pp,) * pp, recompute="none", dp_shard=dp_shard,
              cp_comm="allgather", sequence_parallel=False)


def _flags(plan, ranks):
    mine = [plan.rank(r) for r in ranks]
    assert len({(p.keep_empty, p.overlap_grad_sync) for p in mine}) == 1  # one decision per step
    return mine[0].keep_empty, mine[0].overlap_grad_sync


@pytest.mark.parametrize("dp_shard", [False, True])
def test_first_fit_runs_empty_micro_batches_only_under_fsdp(dp_shard):
    lays = layouts(1, 4, 1, 1, 4)
    lays["llm"].dp_shard = dp_shard
    plan = plan_step(random_sizes(np.random.default_rng(0), 8), lays, "first_fit", 64, EDGES)
    assert _flags(plan, range(4)) == (dp_shard, True)


def test_islands_run_every_micro_batch_on_every_llm_lane():
    lays = island_layouts((1, 2, 1), (1, 1, 2, 1))
    plan = plan_step(random_sizes(np.random.default_rng(1), 8), lays, "first_fit", 64, EDGES)
    assert _flags(plan, range(2, 4)) == (True, True)


@pytest.mark.parametrize("pp, dp_shard, want", [(1, False, (False, False)), (1, True, (True, True)),
                                                (2, False, (True, True))])
def test_dynamic_cp_keeps_empties_under_pp_and_fsdp_and_overlaps_unless_several_per_round(pp, dp_shard, want):
    register_policy("dynamic_cp", dynamic_cp_policy(CFG.llm))
    lens = [30, 40, 150, 20, 60, 35, 45, 25]
    sizes = SampleSizes.from_lists(lens, [n - 1 for n in lens], [[] for _ in lens])
    plan = plan_step(sizes, {"llm": _llm(dp=4, pp=pp, dp_shard=dp_shard)}, "dynamic_cp", 64)
    assert _flags(plan, range(4 * pp)) == want
