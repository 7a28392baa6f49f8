"""Plan mode on the full-size recipes, composed with Hydra as `python train.py +recipe=NAME mode=plan`
composes them (hcp.preflight.plan_mode)."""
import json
from pathlib import Path

import pytest

from hcp.config.errors import ConfigError
from hcp.preflight.plan_mode import run_plan

CONF = Path(__file__).resolve().parents[1] / "conf"
GIB = 2**30
NON_COLOCATED = ["placement=non_colocated", "vision.layout.num_ranks=16", "llm.layout.pp=3",
                 "llm.layout.pp_layers=[13,14,13]"]


def composed(recipe: str, *overrides: str):
    """As train.py composes and resolves it (its run directory a test one)."""
    from cfg_utils import compose_cfg

    return compose_cfg([f"+recipe={recipe}", "mode=plan", *overrides])


def test_llama13b_memory_matches_hand_calculation(tmp_path):
    plan = run_plan(composed("llama13b_dynamic_cp"), tmp_path)
    h, f, v, tokens = 5120, 13824, 32000, 8192
    per_layer = 4 * h * h + 3 * h * f + 2 * h              # q, k, v, o; gate, up, down; 2 RMSNorms
    assert plan["modules"]["llm"]["num_params"] == 40 * per_layer + 2 * v * h + h == 13_015_864_320
    first_params = 5 * per_layer + v * h                    # 5 layers + embedding on stage 0
    last_params = 5 * per_layer + h + v * h                 # 5 layers + final norm + output layer
    # bf16 autocast: the residual stream stays fp32; each RMSNorm keeps its fp32 input and its
    # fp32 normalized output, and each of q/k/v/gate/up keeps its own bf16 cast of its input
    # (autocast casts per op); q, k, v, the attention output and SwiGLU's gate, up, silu and
    # product in bf16 (measured on a real layer: tests/test_plan_memory.py)
    layer_none = tokens * (2 * 2 * h * 4 + 5 * h * 2 + (2 * h + 2 * h + 4 * f) * 2)
    layer_input = tokens * h * 4                            # what full recompute keeps per layer
    copies = (4 * h * h + 3 * h * f) * 2                    # one layer's bf16 weights, while recomputed
    # CP-8 attention backward (all-gather): gathered K/V, index copy and bf16 dK/dV (2 bytes
    # each) and the fp32 dK/dV accumulator over the group's 8 * tokens rows
    cp_attention = 8 * tokens * 2 * h * (3 * 2 + 4)
    # 16 B per parameter: fp32 weights (the master copy), fp32 grads, two fp32 Adam moments
    # (was 18 with a bf16 weight copy hcp does not keep); 8 micro-batches in flight (1F1B)
    first = first_params * 16 + 8 * 5 * layer_input + layer_none + copies + cp_attention
    last = (last_params * 16 + 1 * 5 * layer_input + layer_none + copies + cp_attention + tokens * v * 4
            + v * h * 2)                                    # fp32 logits, the output layer's bf16 copy
    mem = plan["memory_gib"]
    assert mem[0]["total"] == pytest.approx(first / GIB, rel=1e-9)
    assert mem[56]["total"] == pytest.approx(last / GIB, rel=1e-9)
    assert mem[0]["total"] == pytest.approx(41.34, abs=0.01)
    assert mem[0]["weights"] == pytest.approx(first_params * 4 / GIB)
    assert plan["bytes_per_trained_param"] == 16 and plan["logging_rank"] == 56
    assert plan["modules"]["llm"]["groups"]["dynamic_cp_8"] == [8, 8]
    assert [r["first"] for r in plan["rank_map"]] == list(range(0, 64, 8))
    assert json.loads((tmp_path / "plan.json").read_text()) == plan
    assert (tmp_path / "plan.png").stat().st_size > 10_000


def test_llava_hetero_colocated_plan(tmp_path):
    plan = run_plan(composed("llava_hetero"), tmp_path)
    mods = plan["modules"]
    assert {m: mods[m]["island"] for m in mods} == {"vision": [0, 63], "projector": [0, 63], "llm": [0, 63]}
    assert mods["vision"]["layout"] == {"tp": 1, "cp": 1, "pp": 1, "dp": 64, "pp_layers": [23], "recompute": "none"}
    assert mods["llm"]["layout"]["tp"] == 8 and mods["llm"]["groups"]["tp"] == [8, 8]
    assert mods["vision"]["num_params"] == pytest.approx(0.291e9, rel=0.01)
    assert mods["projector"]["num_params"] == 1024 * 5120 + 5120 + 5120 * 5120 + 5120
    assert plan["logging_rank"] == 32 and len(plan["memory_gib"]) == 64
    assert all(r["total"] < 80 for r in plan["memory_gib"])
    assert (tmp_path / "plan.png").exists()


def test_llava_hetero_non_colocated_plan(tmp_path):
    plan = run_plan(composed("llava_hetero", *NON_COLOCATED), tmp_path)
    assert {m: i["island"] for m, i in plan["modules"].items()} == {
        "vision": [0, 15], "projector": [0, 15], "llm": [16, 63]}
    assert plan["logging_rank"] == 48
    assert plan["rank_map"][0] == {"first": 0, "last": 15, "role": "vision pp0, projector pp0"}
    vision_rank, llm_rank = plan["memory_gib"][0], plan["memory_gib"][16]
    assert vision_rank["total"] < 10 < llm_rank["total"]


def test_fp32_assumes_16_bytes_per_parameter(tmp_path):
    plan = run_plan(composed("llama13b_dynamic_cp", "precision=fp32"), tmp_path)
    assert plan["bytes_per_trained_param"] == 16


def test_a_rank_that_does_not_fit_names_the_knob(tmp_path):
    with pytest.raises(ConfigError) as err:
        run_plan(composed("llama13b_dynamic_cp", "llm.layout.pp=1", "llm.layout.cp=64"), tmp_path)
    assert err.value.field == "llm.layout.dp_shard" and "GiB" in str(err.value)
    with pytest.raises(ConfigError) as err:
        run_plan(composed("llama13b_dynamic_cp", "llm.layout.recompute=none",
                          "trainer.micro_batch_tokens=65536"), tmp_path)
    assert err.value.field == "llm.layout.recompute"
    assert (tmp_path / "plan.json").exists()  # the plan is still written, for inspection


def test_world_larger_than_the_cluster_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="exceed"):
        run_plan(composed("llama13b_dynamic_cp", "launcher.nnodes=16", "llm.layout.dp=2"), tmp_path)


# ------------------------------------------------------------- which layout (issue 11, part 5)
def test_plan_mode_plans_the_world_training_would_get(tmp_path):
    from cfg_utils import compose_cfg
    from hcp.launch.launch import local_world_size

    cfg = compose_cfg(["mode=plan"])
    assert run_plan(cfg, tmp_path)["world_size"] == local_world_size(cfg, None) == 4


def test_readable_parameter_counts():
    from hcp.preflight.plan_mode import readable_count

    assert [readable_count(n) for n in (950, 12_345, 1_234_567, 290_900_000, 13_015_864_320, 1.1e12)] == [
        "950", "12.3K", "1.2M", "290.9M", "13.0B", "1.1T"]


def test_groups_crossing_a_node_boundary_are_named():
    from hcp.config.layouts import check_layouts
    from hcp.preflight.plan_mode import node_warnings

    cfg = composed("llama13b_dynamic_cp", "cluster.gpus_per_node=4", "cluster.num_nodes=16")
    warnings = node_warnings(cfg, check_layouts(cfg, 64))
    assert warnings == ["warning: llm: 8 of 8 dynamic-CP groups of size 8 cross a node boundary, e.g. "
                        "ranks 0-7: their K/V exchange runs over the inter-node network"]
    cfg = composed("llava_hetero", "cluster.gpus_per_node=4", "cluster.num_nodes=16")
    (w,) = node_warnings(cfg, check_layouts(cfg, 64))
    assert w.startswith("warning: llm: 8 of 8 TP groups cross a node boundary (cluster.gpus_per_node=4), "
                        "e.g. ranks 0-7 on nodes 0-1")
    assert node_warnings(composed("llava_hetero"), check_layouts(composed("llava_hetero"), 64)) == []


@pytest.mark.slow
def test_estimate_covers_the_step_and_dynamic_cp_beats_packing_only():
    from hcp.config.layouts import resolve_layouts
    from hcp.model.flops import model_flops
    from hcp.preflight.estimate import batch_lengths, estimate_step

    def estimate(recipe, *overrides):
        cfg = composed(recipe, *overrides)
        llm = resolve_layouts(cfg, 64)["llm"]
        return estimate_step(cfg, llm, 64, [1_000_000_000] * llm.pp)

    dyn, ff = estimate("llama13b_dynamic_cp"), estimate("llama13b_dynamic_cp", "packing=first_fit")
    cfg = composed("llama13b_dynamic_cp")
    lens = batch_lengths(cfg).astype(float)
    flops = model_flops(cfg.llm, lens.sum(), (lens**2).sum())
    for est in (dyn, ff):
        assert est["tflops_per_gpu"] * 1e12 * est["step_time_s"] * 64 == pytest.approx(flops)
        assert 0 < est["bubble_fraction"] < 1 and est["grad_sync_s"] > 0
    assert dyn["step_time_s"] < ff["step_time_s"]
    tp8, tp4 = estimate("llava_hetero"), estimate("llava_hetero", "llm.layout.tp=4")
    assert tp4["grad_sync_s"] > tp8["grad_sync_s"]  # the same stage parameters over twice the DP ranks


def test_dynamic_cp_estimate_times_the_plan_training_would_run():
    """Plan mode's estimate packs its batch with the policy the step plan runs (not a copy of
    the solver call): the same micro-batches, CP sizes and blocks as the trainer's plan of those
    lengths (a copy that skipped the policy's length preparation and row layout did not)."""
    from hcp.config.layouts import resolve_layouts
    from hcp.dcp.policy import dynamic_cp_policy
    from hcp.plan.lengths import SampleSizes
    from hcp.plan.step import plan_step, register_policy
    from hcp.preflight import estimate

    cfg = composed("llama_tiny", "packing=dynamic_cp", "trainer.global_batch_size=32", "data.max_seq_len=2048",
                   "trainer.micro_batch_tokens=256", "launcher.nproc_per_node=8")
    llm = resolve_layouts(cfg, 8)["llm"]
    register_policy("dynamic_cp", dynamic_cp_policy(cfg.llm, cfg.packing_profile))
    lens = estimate.batch_lengths(cfg).tolist()
    trained = plan_step(SampleSizes.from_lists(lens, [n - 1 for n in lens], [[] for _ in lens]),
                        {"llm": llm}, "dynamic_cp", 256).packing
    [(planned, _)] = estimate.pool_plans(cfg, llm)
    key = lambda plan: [[(tuple(g.seq_indices), g.cp_size, g.rank_offset) for g in r.groups]  # noqa: E731
                        for r in plan.rounds]
    assert key(planned) == key(trained) and len({g.cp_size for r in trained.rounds for g in r.groups}) > 1


def test_plan_figure_shows_node_boundaries_and_memory_against_the_device():
    from hcp.config.layouts import check_layouts
    from hcp.preflight.plan_figure import plan_figure

    cfg = composed("llava_hetero")
    mem = [10.0 + r for r in range(64)]
    fig = plan_figure(check_layouts(cfg, 64), 64, 8, mem, 70.0)
    placement, memory = fig.axes
    for ax in (placement, memory):
        xs = [l.get_xdata()[0] for l in ax.get_lines() if l.get_linestyle() == "--"]
        assert xs == [8, 16, 24, 32, 40, 48, 56]
    assert [p.get_height() for p in memory.patches] == mem
    assert sum(p.get_facecolor()[0] > 0.8 for p in memory.patches) == 64 - 61  # 71-73 GiB do not fit
    assert any(l.get_ydata()[0] == 70.0 for l in memory.get_lines())


def test_a_plan_sweep_ends_with_one_comparison_table(tmp_path, capsys):
    from omegaconf import OmegaConf

    from hcp.preflight.plan_table import PlanSweepTable

    jobs = [(["llm.layout.tp=8", "llm.layout.pp=2"], {"max_memory_gib": 29.9, "fits": True, "step_time_s": 0.47}),
            (["llm.layout.tp=4", "llm.layout.pp=1"], {"max_memory_gib": 92.6, "fits": False, "step_time_s": 0.3}),
            (["llm.layout.tp=4", "llm.layout.pp=2"], {"max_memory_gib": 45.2, "fits": True, "step_time_s": 0.64}),
            (["llm.layout.tp=16", "llm.layout.pp=2"], None)]
    for job, (overrides, est) in enumerate(jobs):
        d = tmp_path / str(job)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(
            "\n".join(f"- {o}" for o in ["+recipe=llava_hetero", "mode=plan", *overrides]))
        if est is None:
            (d / "plan_error.txt").write_text("llm.layout.tp=16: llm.num_heads=40 is not divisible by it")
        else:
            est |= {"tflops_per_gpu": 100 / est["step_time_s"], "bubble_fraction": 0.125}
            (d / "plan.json").write_text(json.dumps({"estimate": est}))
    (tmp_path / "10").mkdir()  # a job folder that is not a plan's is left out
    PlanSweepTable().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    out = capsys.readouterr().out.splitlines()
    assert [line.split() for line in out[1:6]] == [
        ["layout", "max", "mem/rank", "GiB", "fits", "est.", "step", "s", "est.", "TFLOPS/GPU", "bubble"],
        ["llm.layout.tp=8", "llm.layout.pp=2", "29.9", "yes", "0.47", "213", "12.5%", "<-", "fastest", "that", "fits"],
        ["llm.layout.tp=4", "llm.layout.pp=1", "92.6", "NO", "0.3", "333", "12.5%"],
        ["llm.layout.tp=4", "llm.layout.pp=2", "45.2", "yes", "0.64", "156", "12.5%"],
        ["llm.layout.tp=16", "llm.layout.pp=2", "-", "invalid", "-", "-", "-"]]
    assert out[6] == "invalid llm.layout.tp=16 llm.layout.pp=2: llm.layout.tp=16: llm.num_heads=40 is not divisible by it"
    assert (tmp_path / "plan_comparison.txt").read_text().splitlines() == out[:-1]


def test_the_sweep_table_callback_is_registered():
    from hydra import compose, initialize_config_dir

    from hcp.config.schema import register

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("config", overrides=["mode=plan"], return_hydra_config=True)
    assert cfg.hydra.callbacks.plan_table._target_ == "hcp.preflight.plan_table.PlanSweepTable"
