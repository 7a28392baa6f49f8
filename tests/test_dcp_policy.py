"""The dynamic_cp policy inside the step plan: valid per-rank plans, rows of rounds, errors."""
from types import SimpleNamespace as NS

import numpy as np
import pytest

from omegaconf import OmegaConf

from hcp.config.capacity import max_length, tokens_per_rank
from cfg_utils import REPO
from hcp.config.compose import compose_config
from hcp.config.errors import ConfigError
from hcp.config.validate import validate
from hcp.dcp.packing import Group, Packing, Round, prepare_lengths, rank_tokens, validate_plan
from hcp.dcp.policy import check_dynamic_cp, dynamic_cp_policy, rows
from hcp.plan.lengths import SampleSizes
from hcp.plan.step import plan_step, register_policy

CFG = compose_config(["+recipe=llama_tiny"])
DYNAMIC = compose_config(["+recipe=llama_tiny", "packing=dynamic_cp"])
register_policy("dynamic_cp", dynamic_cp_policy(CFG.llm))


def lay(tp=1, cp=1, dp=1, pp=1, dp_shard=False):
    return NS(module="llm", tp=tp, cp=cp, pp=pp, dp=dp, rank_offset=0,
              num_ranks=tp * cp * pp * dp, pp_layers=(CFG.llm.num_layers // pp,) * pp,
              recompute="none", dp_shard=dp_shard, cp_comm="allgather",
              sequence_parallel=False)


def sizes(tokens):
    return SampleSizes.from_lists(list(tokens), list(tokens), [[] for _ in tokens])


@pytest.mark.parametrize("layout", [dict(dp=4), dict(dp=2, cp=2), dict(dp=4, tp=2),
                                    dict(dp=4, pp=2), dict(dp=4, dp_shard=True), dict(dp=8)])
def test_every_rank_gets_the_same_count_and_caps_hold(layout):
    rng = np.random.default_rng(5)
    tokens = np.r_[rng.integers(20, 300, 30), [700, 1000]]
    llm = lay(**layout)
    plan = plan_step(sizes(tokens), {"llm": llm}, "dynamic_cp", 256)
    ranks = [plan.rank(r) for r in range(llm.num_ranks)]
    assert len({len(p.micro_batches) for p in ranks}) == 1
    placed = sorted(s for p in ranks for mb in p.micro_batches if mb.cp_rank == 0
                    for s in mb.samples)
    assert placed == sorted(list(range(len(tokens))) * llm.tp * llm.pp)  # every TP/PP copy
    assert all(mb.local_tokens <= 256 for p in ranks for mb in p.micro_batches)
    sizes_used = {mb.cp_size for p in ranks for mb in p.micro_batches if not mb.empty}
    assert max(sizes_used) >= 4  # the 1000-token sample needs a CP group of >= 4 ranks


def test_selective_recompute_keeps_the_plan_of_none_and_only_its_estimate_grows():
    # the planner prices full recompute only (planned_recompute: on the 13B model a planner that
    # saw selective's attention-core forward would pack this batch otherwise); the step
    # estimate times that forward on the plan of none
    from hcp.preflight.estimate import cost_model, hardware, lane_stage_times

    cfg = compose_config(["+recipe=llama13b_dynamic_cp"])
    rng = np.random.default_rng(0)
    tokens = np.minimum(rng.lognormal(7.5, 1.2, 64).astype(int) + 10, 32768)
    base = dict(module="llm", tp=8, cp=1, pp=1, dp=8, rank_offset=0, num_ranks=64, pp_layers=(cfg.llm.num_layers,),
                dp_shard=False, cp_comm="allgather", sequence_parallel=False)
    by = {r: NS(**base, recompute=r) for r in ("none", "selective")}
    key = lambda plan: [[(tuple(g.seq_indices), g.cp_size) for g in r.groups] for r in plan.rounds]  # noqa: E731
    (plan0, f0, b0), = lane_stage_times(cfg, by["none"], cost_model(cfg, by["none"], hardware(cfg)), tokens)
    (plan1, f1, b1), = lane_stage_times(cfg, by["selective"], cost_model(cfg, by["selective"], hardware(cfg)), tokens)
    assert key(plan1) == key(plan0) and np.array_equal(f0, f1)
    assert (b1 >= b0).all() and b1.sum() > b0.sum()


def test_rows_lay_out_a_round_as_one_micro_batch_per_group():
    plan = Packing([Round([Group([0, 1, 2], 2, 0, [1, 2]), Group([3], 1, 2), Group([], 1, 3)])])
    out = rows(plan)
    assert [[g.seq_indices for g in r.groups] for r in out.rounds] == [[[0], [3], []],
                                                                       [[1, 2], [], []]]
    validate_plan(out, [5, 5, 5, 5], 4, 100)


def test_fewer_samples_than_pool_ranks_leave_ranks_with_empty_micro_batches():
    llm = lay(dp=8)
    plan = plan_step(sizes([50, 60]), {"llm": llm}, "dynamic_cp", 256)
    ranks = [plan.rank(r) for r in range(8)]
    assert len({len(p.micro_batches) for p in ranks}) == 1
    assert sum(not mb.empty for p in ranks for mb in p.micro_batches if mb.cp_rank == 0) <= 2


def test_clear_errors_before_ranks_start():
    bad = compose_config(["+recipe=llama_tiny", "packing_profile=/nonexistent.yaml"])
    with pytest.raises(ConfigError, match="packing_profile='/nonexistent.yaml'") as e:
        check_dynamic_cp(bad)
    assert str(e.value).count("nonexistent.yaml") == 1, e.value  # the value named once
    import subprocess  # mode=plan: an error (exit 2), not a "training refuses this layout" warning
    import sys

    proc = subprocess.run([sys.executable, "train.py", "+recipe=llama_tiny", "packing=dynamic_cp",
                           "packing_profile=/nonexistent.yaml", "mode=plan", "hydra.run.dir=/tmp/hcp-plan-profile"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "hcp: error: packing_profile='/nonexistent.yaml'" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "train.py", "+recipe=llama_tiny", "resume=/nonexistent",
                           "mode=plan", "hydra.run.dir=/tmp/hcp-plan-resume"],  # the run it plans refuses it
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "hcp: error: resume='/nonexistent'" in proc.stderr, proc.stderr


@pytest.mark.parametrize("pool", [1, 2, 4, 8, 16])
def test_the_config_check_and_the_planner_accept_the_same_longest_sample(pool):
    """One rule (hcp.config.capacity) for `validate` and the planner: a sample of `limit`
    tokens plans at every cap, one more token is refused by both, and `tokens_per_rank` is the
    smallest cap that holds it (head-tail padding to 2c counted)."""
    for cap in (2, 7, 128, 1023):
        limit = max_length(pool, cap)
        assert rank_tokens(limit, pool) <= cap < rank_tokens(limit + 1, pool)
        assert tokens_per_rank(limit + 1, pool) == rank_tokens(limit + 1, pool) > cap
        prepare_lengths([limit], pool, cap)
        with pytest.raises(ValueError, match=f"more than the pool can hold: {limit}"):
            prepare_lengths([limit + 1], pool, cap)
        cfg = OmegaConf.merge(DYNAMIC, {"trainer": {"micro_batch_tokens": cap},
                                        "launcher": {"nproc_per_node": pool},
                                        "data": {"max_seq_len": limit + 1}})
        with pytest.raises(ConfigError, match=f"at most {limit} tokens") as e:
            validate(cfg, world_size=pool)
        assert e.value.field == "trainer.micro_batch_tokens"
        assert f"trainer.micro_batch_tokens >= {tokens_per_rank(limit + 1, pool)}" in e.value.fix
        validate(OmegaConf.merge(cfg, {"data": {"max_seq_len": limit}}), world_size=pool)


def test_tp_and_pp_peers_run_the_same_micro_batches_and_group_members_agree():
    """What keeps TP > 1 and PP > 1 from hanging (Megatron's first dynamic-CP version hung with
    TP > 1): every TP rank and every stage of a pool position runs the same micro-batches in the
    same order, and at each micro-batch the members of a pre-built group (Grid.dynamic_cp_groups)
    all run it, each with its own shard index."""
    from hcp.parallel.grid import Grid

    rng = np.random.default_rng(3)
    tokens = np.r_[rng.integers(20, 300, 30), [700, 1000]]
    llm = lay(tp=2, cp=2, dp=2, pp=2)
    plan = plan_step(sizes(tokens), {"llm": llm}, "dynamic_cp", 256)
    grid = Grid.of(llm)
    key = [[(mb.samples, mb.cp_size, mb.cp_block, mb.cp_rank) for mb in plan.rank(r).micro_batches]
           for r in range(llm.num_ranks)]
    for r in range(llm.num_ranks):
        c = grid.coords(r)
        assert key[r] == key[int(grid.ranks[0, c["dp"], c["cp"], 0])]  # its tp 0, stage 0 peer
    seen = set()
    for r in range(llm.num_ranks):
        for j, (samples, size, block, shard) in enumerate(key[r]):
            members = grid.dynamic_cp_groups(size)[grid.dynamic_cp_index(size, r)].tolist()
            assert members.index(r) == shard and block == (grid.coords(r)["dp"] * llm.cp + grid.coords(r)["cp"]) // size
            assert all(key[m][j][:3] == (samples, size, block) for m in members)
            seen.add(size)
    assert {1, 2, 4} <= seen
