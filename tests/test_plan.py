"""Plan mode on the full-size recipes, composed with Hydra as `python train.py +recipe=NAME mode=plan`
composes them (hcp.train.plan)."""
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from hcp.config.errors import ConfigError
from hcp.config.schema import register
from hcp.train.plan import run_plan

CONF = Path(__file__).resolve().parents[1] / "conf"
GIB = 2**30
NON_COLOCATED = ["placement=non_colocated", "vision.layout.num_ranks=16", "llm.layout.pp=3",
                 "llm.layout.pp_layers=[13,14,13]"]


def composed(recipe: str, *overrides: str):
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=[f"+recipe={recipe}", "mode=plan", *overrides])


def test_llama13b_memory_matches_hand_calculation(tmp_path):
    plan = run_plan(composed("llama13b_dynamic_cp"), tmp_path)
    h, f, v, tokens = 5120, 13824, 32000, 8192
    per_layer = 4 * h * h + 3 * h * f + 2 * h              # q, k, v, o; gate, up, down; 2 RMSNorms
    assert plan["modules"]["llm"]["num_params"] == 40 * per_layer + 2 * v * h + h == 13_015_864_320
    first_params = 5 * per_layer + v * h                    # 5 layers + embedding on stage 0
    last_params = 5 * per_layer + h + v * h                 # 5 layers + final norm + output layer
    layer_none = tokens * (6 * h + 2 * h + 3 * f) * 2       # one layer's bf16 activations, no recompute
    layer_input = tokens * h * 2                            # what full recompute keeps per layer
    first = first_params * 18 + 8 * 5 * layer_input + layer_none   # 8 micro-batches in flight
    last = last_params * 18 + 1 * 5 * layer_input + layer_none + tokens * v * 4   # + fp32 logits
    mem = plan["memory_gib"]
    assert mem[0]["total"] == pytest.approx(first / GIB, rel=1e-9)
    assert mem[56]["total"] == pytest.approx(last / GIB, rel=1e-9)
    assert mem[0]["total"] == pytest.approx(33.72, abs=0.01)
    assert mem[0]["weights"] == pytest.approx(first_params * 2 / GIB)
    assert plan["bytes_per_trained_param"] == 18 and plan["logging_rank"] == 56
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
