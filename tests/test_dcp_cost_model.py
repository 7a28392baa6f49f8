"""Cost model: FLOP counts, scaling with CP size, bandwidth tiers, the additive floor."""
import numpy as np
import pytest

from hcp.dcp.cost_model import LLAMA_13B, CostModel, HardwareProfile, load_cost
from hcp.dcp.plan import Group, MicroBatch, Plan


def test_llama13b_shape_and_model_flops():
    assert LLAMA_13B.layer_params == 4 * 5120**2 + 3 * 5120 * 13824
    cost = load_cost("h100-llama13b", pp=1)
    # Megatron per layer: 4 T h (h + h g / n) + 6 T h f + 2 h sum L^2, head 2 T h V; x3.
    L = np.array([1000, 3000])
    t, s, h = 4000, 1000**2 + 3000**2, 5120
    want = 3 * (40 * (4 * t * h * 2 * h + 6 * t * h * 13824 + 2 * h * s) + 2 * t * h * 32000)
    assert cost.model_flops(L) == pytest.approx(want, rel=1e-12)


def test_profile_yaml_loads_and_rejects_missing_keys(tmp_path):
    hw = load_cost("h100-llama13b", pp=8).hw
    assert hw.peak_flops == 989e12 and hw.ranks_per_node == 8
    bad = tmp_path / "bad.yaml"
    bad.write_text("peak_flops: 1.0e+15\n")
    with pytest.raises(ValueError, match="missing keys"):
        HardwareProfile.from_yaml(bad)
    with pytest.raises(ValueError, match="neither"):
        load_cost(str(tmp_path / "nope.yaml"), pp=1)


def test_compute_divides_by_cp_and_comm_grows_with_it():
    cost = load_cost("h100-llama13b", pp=2)
    L = 16384
    f1, f2, f8 = (cost.fwd(L, L * L, c) for c in (1, 2, 8))
    assert f1.shape == (2,)
    assert (f2 < f1).all() and (f8 < f2).all()
    assert (8 * f8 > f1).all()  # CP adds exposed communication: rank-seconds grow
    assert f1[1] > f1[0]  # the last stage also runs the LM head


def test_inter_node_cp_is_slower_than_intra_node():
    cost = load_cost("h100-llama13b", pp=1)
    L = 131072
    _, _, comm8 = cost._parts(L, L * L, 8)
    _, _, comm16 = cost._parts(L, L * L, 16)
    bw_ratio = cost.hw.nvlink_bandwidth / cost.hw.ib_bandwidth
    assert comm16 / comm8 == pytest.approx(bw_ratio * (15 / 16) / (7 / 8))


def test_floor_is_additive_lower_envelope_of_group_time():
    cost = load_cost("h100-llama13b", pp=4)
    lens = np.array([300, 5000, 12000, 40000], dtype=float)
    for c in (1, 2, 4, 8):
        group = cost.fwd(lens.sum(), (lens**2).sum(), c)
        parts = cost.fwd_floor(lens, lens**2, c).sum(axis=1)
        assert (group >= parts - 1e-15).all()


def test_stage_times_take_slowest_group_plus_overhead():
    cost = CostModel(LLAMA_13B, load_cost("h100-llama13b", 1).hw, pp=1, recompute=False)
    lens = [4000, 100, 100]
    plan = Plan([MicroBatch([Group([0], 2, 0), Group([1, 2], 2, 2)])])
    fwd, bwd = cost.stage_times(plan, lens)
    slow = cost.fwd(4000, 4000**2, 2)[0]
    assert fwd[0, 0] == pytest.approx(slow + cost.hw.micro_batch_overhead_fwd)
    assert bwd[0, 0] == pytest.approx(2 * slow + cost.hw.micro_batch_overhead_bwd)
