"""Cost model: FLOP counts, scaling with CP size, bandwidth tiers, the additive floor."""
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hcp.config.errors import ConfigError
from hcp.dcp.cost_model import CostModel, load_cost, recipe_llm
from hcp.dcp.hardware import HardwareProfile, load_profile
from hcp.dcp.packing import Group, Round, Packing


def test_llama13b_shape_and_model_flops():
    llm = recipe_llm()
    assert (llm.num_layers, llm.hidden_size, llm.ffn_hidden_size) == (40, 5120, 13824)
    cost = load_cost(llm, pp=1)
    # Megatron per layer: 4 T h (h + h g / n) + 6 T h f + 2 h sum L^2, head 2 T h V; x3.
    L = np.array([1000, 3000])
    t, s, h = 4000, 1000**2 + 3000**2, 5120
    want = 3 * (40 * (4 * t * h * 2 * h + 6 * t * h * 13824 + 2 * h * s) + 2 * t * h * 32000)
    assert cost.model_flops(L) == pytest.approx(want, rel=1e-12)


def test_profile_yaml_loads_and_rejects_missing_keys(tmp_path):
    hw = load_profile("h100")
    assert hw.peak_flops == 989e12 and hw.ranks_per_node == 8
    bad = tmp_path / "bad.yaml"
    bad.write_text("peak_flops: 1.0e+15\n")
    with pytest.raises(ValueError, match="missing keys"):
        HardwareProfile.from_yaml(bad)
    with pytest.raises(ValueError, match="neither"):
        load_profile(str(tmp_path / "nope.yaml"))


def test_compute_divides_by_cp_and_comm_grows_with_it():
    cost = load_cost(recipe_llm(), pp=2)
    L = 16384
    f1, f2, f8 = (cost.fwd(L, L * L, c) for c in (1, 2, 8))
    assert f1.shape == (2,)
    assert (f2 < f1).all() and (f8 < f2).all()
    assert (8 * f8 > f1).all()  # CP adds exposed communication: rank-seconds grow
    assert f1[1] > f1[0]  # the last stage also runs the LM head


def test_inter_node_cp_is_slower_than_intra_node():
    cost = load_cost(recipe_llm(), pp=1)
    L = 131072
    _, _, comm8 = cost._parts(L, L * L, 8)
    _, _, comm16 = cost._parts(L, L * L, 16)
    bw_ratio = cost.hw.nvlink_bandwidth / cost.hw.ib_bandwidth
    assert comm16 / comm8 == pytest.approx(bw_ratio * (15 / 16) / (7 / 8))


def test_floor_is_additive_lower_envelope_of_group_time():
    cost = load_cost(recipe_llm(), pp=4)
    lens = np.array([300, 5000, 12000, 40000], dtype=float)
    for c in (1, 2, 4, 8):
        group = cost.fwd(lens.sum(), (lens**2).sum(), c)
        parts = cost.fwd_floor(lens, lens**2, c).sum(axis=1)
        assert (group >= parts - 1e-15).all()


def test_stage_times_take_slowest_group_plus_overhead():
    cost = CostModel(recipe_llm(), load_profile("h100"), pp=1, recompute="none")
    lens = [4000, 100, 100]
    plan = Packing([Round([Group([0], 2, 0), Group([1, 2], 2, 2)])])
    fwd, bwd = cost.stage_times(plan, lens)
    slow = cost.fwd(4000, 4000**2, 2)[0]
    assert fwd[0, 0] == pytest.approx(slow + cost.hw.micro_batch_overhead_fwd)
    assert bwd[0, 0] == pytest.approx(2 * slow + cost.hw.micro_batch_overhead_bwd)


def test_selective_recompute_runs_the_attention_cores_forward_again_in_backward():
    """`recompute=selective` adds each micro-batch's attention core forward (scores; under CP
    its exposed K/V traffic and latency) to the backward, full adds the whole forward, none
    nothing; the forward is the same for all three, and an unknown mode names the field."""
    hw = load_profile("h100")
    lens = [16000, 3000, 500, 500]
    plan = Packing([Round([Group([0], 4, 0)]), Round([Group([1, 2, 3], 1, 0)])])
    runs = {r: CostModel(recipe_llm(), hw, pp=2, recompute=r) for r in ("none", "selective", "full")}
    times = {r: cost.stage_times(plan, lens) for r, cost in runs.items()}
    none, sel, full = (times[r] for r in ("none", "selective", "full"))
    assert np.array_equal(none[0], sel[0]) and np.array_equal(none[0], full[0])
    cost = runs["none"]
    attention = cost.fwd(16000, 16000**2, 1) - cost.fwd(16000, 0, 1)  # at c = 1 the core is its scores
    assert cost.core_fwd(16000, 16000**2, 1) == pytest.approx(attention, rel=1e-12)
    assert (cost.core_fwd(16000, 16000**2, 4) > cost.attn_coef * 16000**2 / 4).all()  # + K/V traffic
    core = np.stack([cost.core_fwd(16000, 16000**2, 4), cost.core_fwd(3500, 3000**2 + 2 * 500**2, 1)], axis=1)
    assert sel[1] - none[1] == pytest.approx(core, rel=1e-12) and (core > 0).all()
    assert full[1] - none[1] == pytest.approx(none[0] - cost.hw.micro_batch_overhead_fwd, rel=1e-12)
    with pytest.raises(ConfigError, match="recompute=True: unknown value"):
        CostModel(recipe_llm(), hw, recompute=True)


def test_cost_model_takes_the_run_config_layout():
    """pp, tp, recompute and pp_layers come from `llm.layout` (the recipe: pp 8, full
    recompute); tp divides compute and K/V traffic per GPU."""
    llm = recipe_llm()
    cost = CostModel(llm, load_profile("h100"))
    assert (cost.pp, cost.tp, cost.bwd_factor) == (8, 1, 3.0)
    tp2 = CostModel(llm, load_profile("h100"), tp=2)
    L = 8192
    _, _, comm1 = cost._parts(L, L * L, 2)
    compute1, _, _ = cost._parts(L, L * L, 2)
    compute2, _, comm2 = tp2._parts(L, L * L, 2)
    np.testing.assert_allclose(compute2, compute1 / 2)
    np.testing.assert_allclose(comm2, comm1 / 2)  # c * tp = 4 <= 8: still NVLink
    uneven = CostModel(llm, load_profile("h100"), pp=2, pp_layers=[30, 10])
    f = uneven.fwd(L, L * L, 1)
    assert f[0] > 2 * f[1]  # 30 layers against 10 plus the head


def test_cp_group_strided_by_tp_leaves_the_node_at_c_times_tp():
    """A CP group of c ranks spans c * tp GPUs: at tp 2 a group of 8 crosses InfiniBand
    (it did not before: the check was c <= ranks_per_node)."""
    hw = load_profile("h100")
    tp1 = CostModel(recipe_llm(), hw, pp=1, tp=1)
    tp2 = CostModel(recipe_llm(), hw, pp=1, tp=2)
    assert tp1.bandwidth(8) == hw.nvlink_bandwidth
    assert tp2.bandwidth(4) == hw.nvlink_bandwidth
    assert tp2.bandwidth(8) == hw.ib_bandwidth
    L = 65536
    _, _, c4 = tp2._parts(L, L * L, 4)
    _, _, c8 = tp2._parts(L, L * L, 8)
    assert c8 / c4 == pytest.approx(hw.nvlink_bandwidth / hw.ib_bandwidth * (7 / 8) / (3 / 4))


def test_one_model_flops_implementation():
    """The trainer's TFLOPS and the cost model count the same FLOPs (hcp/model/flops.py)."""
    from hcp.config.compose import compose_config
    from hcp.train.throughput import model_flops

    llm = compose_config(["+recipe=llama_tiny"]).llm
    lens = np.array([5, 100, 37])
    cost = CostModel(llm, load_profile("h100"), pp=1)
    assert cost.model_flops(lens) == model_flops(llm, lens.sum(), (lens**2).sum())


def _with_latency(lat=2e-4, pp=1):
    hw = HardwareProfile(**{**load_profile("h100").__dict__, "cp_latency": lat})
    return CostModel(recipe_llm(), hw, pp=pp, recompute="none")


def test_cp_latency_is_paid_once_per_micro_batch_per_ring_step():
    """alpha (c - 1) per layer on top of the bandwidth term; the floor stays additive (it
    leaves the per-micro-batch latency out) and local search's scalar time includes it."""
    from hcp.dcp.local_search import GroupTime

    lat, base = _with_latency(), _with_latency(0.0)
    lens = np.array([300, 5000, 12000], dtype=float)
    t, s = lens.sum(), (lens**2).sum()
    for c in (1, 2, 8):
        extra = lat.fwd(t, s, c)[0] - base.fwd(t, s, c)[0]
        assert extra == pytest.approx(2e-4 * 40 * (c - 1), rel=1e-9, abs=1e-15)
        assert lat.fwd(t, s, c)[0] >= lat.fwd_floor(lens, lens**2, c).sum() - 1e-15
        assert GroupTime(lat)(t, s, c) == pytest.approx(float(lat.fwd(t, s, c)[0]), rel=1e-12)
    assert (lat.fwd(0.0, 0.0, 8) == 0).all()  # an empty group runs no collective
    per_stage = _with_latency(pp=4).latency(4)  # each stage's layers pay it
    assert per_stage.shape == (4,) and per_stage.sum() == pytest.approx(2e-4 * 40 * 3)


def test_cp_overhead_is_paid_once_per_micro_batch_at_its_cp_size(tmp_path):
    """Issue 24: a fixed cost per micro-batch and layer at each CP size (`cp_overhead`), on top
    of the ring latency; sizes not listed take the largest listed below; the floor stays
    additive; local search and the pipeline stages see it; a bad entry is a one-line error."""
    from hcp.dcp.local_search import GroupTime

    fixed = {2: 3e-4, 8: 1e-4}
    hw = HardwareProfile(**{**load_profile("h100").__dict__, "cp_latency": 2e-4, "cp_overhead": fixed})
    cost, base = CostModel(recipe_llm(), hw, pp=1, recompute="none"), _with_latency()
    lens = np.array([300, 5000, 12000], dtype=float)
    t, s = lens.sum(), (lens**2).sum()
    for c, e in ((1, 0.0), (2, 3e-4), (4, 3e-4), (8, 1e-4)):
        assert cost.fwd(t, s, c)[0] - base.fwd(t, s, c)[0] == pytest.approx(e * 40, abs=1e-15)
        assert cost.fwd(t, s, c)[0] >= cost.fwd_floor(lens, lens**2, c).sum() - 1e-15
        assert GroupTime(cost)(t, s, c) == pytest.approx(float(cost.fwd(t, s, c)[0]), rel=1e-12)
    assert (cost.fwd(0.0, 0.0, 8) == 0).all()
    staged = CostModel(recipe_llm(), hw, pp=4, recompute="none")
    assert staged.latency(2).sum() == pytest.approx(40 * (2e-4 + 3e-4))
    assert staged.one_stage("sum").latency(2)[0] == pytest.approx(40 * (2e-4 + 3e-4))
    text = (Path(__file__).resolve().parents[1] / "hcp/dcp/profiles/h100.yaml").read_text()
    (tmp_path / "bad.yaml").write_text(text + "cp_overhead: {2: -1.0e-4}\n")
    with pytest.raises(ValueError, match=r"cp_overhead=\{2: -0.0001\}: invalid value.*seconds >= 0"):
        load_profile(tmp_path / "bad.yaml")


def test_a_profile_without_cp_latency_loads_with_none(tmp_path):
    text = (Path(__file__).resolve().parents[1] / "hcp/dcp/profiles/h100.yaml").read_text()
    lines = [x for x in text.splitlines() if not x.startswith("cp_latency")]
    (tmp_path / "p.yaml").write_text("\n".join(lines))
    assert HardwareProfile.from_yaml(tmp_path / "p.yaml").cp_latency == 0.0
    (tmp_path / "q.yaml").write_text("\n".join(lines + ["cp_latncy: 1.0e-6"]))
    with pytest.raises(ValueError, match="unknown keys"):
        HardwareProfile.from_yaml(tmp_path / "q.yaml")


@settings(max_examples=20, derandomize=True, deadline=None)
@given(st.lists(st.integers(1, 4096), min_size=1, max_size=40), st.sampled_from([2, 4, 8]),
       st.sampled_from([512, 1024]))
def test_lower_bound_with_cp_latency_stays_below_every_plan(raw, pool, cap):
    """The bound counts each sequence's share of its micro-batch's latency (lower_bound.py
    step 1); it must stay below the simulated time of every planner's plan, and rise."""
    from hcp.dcp.baselines import greedy, packing_only
    from hcp.dcp.lower_bound import lower_bound
    from hcp.dcp.packing import prepare_lengths
    from hcp.dcp.solver import simulate_plan, solve

    lat = 5e-4  # s per ring step and layer: latency-heavy, like gloo's
    cost, base = _with_latency(lat), _with_latency(0.0)
    lens, _ = prepare_lengths(raw, pool, cap, on_overlong="truncate")
    for rounds in (False, True):
        bound = lower_bound(lens, cost, pool, cap, several_per_round=rounds)
        assert bound >= lower_bound(lens, base, pool, cap, several_per_round=rounds)
        plans = [greedy(lens, pool, cap), packing_only(lens, pool, cap),
                 solve(lens, cost, pool, cap, several_per_round=rounds).plan]
        for plan in plans:
            assert bound <= simulate_plan(plan, lens, cost).iteration_time * (1 + 1e-9)
    if (lens > cap).any():  # some sequence needs CP: the bound sees its latency
        assert lower_bound(lens, cost, pool, cap, True) > lower_bound(lens, base, pool, cap, True)


def test_per_cp_size_attention_reaches_every_solver_time():
    """`cp_attention_efficiency` scales the attention term at c > 1 in `fwd`, the additive
    floor and local search's scalar time alike (they must stay equal / below)."""
    from hcp.dcp.local_search import GroupTime

    hw = HardwareProfile(**{**load_profile("h100").__dict__, "cp_attention_efficiency": {2: 0.15}})
    per_cp, base = CostModel(recipe_llm(), hw, pp=1), CostModel(recipe_llm(), load_profile("h100"), pp=1)
    lens = np.array([300, 5000, 12000], dtype=float)
    t, s = lens.sum(), (lens**2).sum()
    assert per_cp.fwd(t, s, 1)[0] == base.fwd(t, s, 1)[0]
    for c in (2, 8):
        _, attn, _ = per_cp._parts(t, s, c)
        assert attn[0] == pytest.approx(3.0 * base._parts(t, s, c)[1][0])   # 0.45 / 0.15
        assert GroupTime(per_cp)(t, s, c) == pytest.approx(float(per_cp.fwd(t, s, c)[0]), rel=1e-12)
        assert per_cp.fwd(t, s, c)[0] >= per_cp.fwd_floor(lens, lens**2, c).sum() - 1e-15
