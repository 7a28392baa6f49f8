"""Plan mode's per-rank memory by placement (issue 14 section 5): a rank is charged only its
island's modules, encoder-side activations follow the images the schedule holds (the whole
step's under the colocated three phases, a few micro-batches' on an island), and the colocated
phase-3 recompute never coincides with the LLM's activations."""
from __future__ import annotations

import pytest

from hcp.config.compose import compose_config
from hcp.config.layouts import check_layouts
from hcp.parallel.roles import role_table
from hcp.preflight.plan_mode import memory_per_rank, stage_memory

GIB = 2**30
NON_COLOCATED = ["placement=non_colocated", "vision.layout.num_ranks=16", "llm.layout.pp=3",
                 "llm.layout.pp_layers=[13,14,13]"]


def _plan(recipe, *overrides):
    cfg = compose_config([f"+recipe={recipe}", "mode=plan", *overrides])
    world = cfg.launcher.nnodes * cfg.launcher.nproc_per_node
    layouts = check_layouts(cfg, world)
    return cfg, layouts, stage_memory(cfg, layouts), memory_per_rank(cfg, layouts, world)


def _vit_layer_bytes(tokens):
    h, f = 1024, 4096                    # CLIP ViT-L: no recompute, GELU MLP, tp1, bf16
    copies = (4 * h * h + 2 * h * f) * 2  # the bf16 copy of each matrix
    return tokens * (2 * h * 4 + 4 * h * 2 + (2 * h + 2 * h + 2 * f) * 2) + copies  # fp32 residual stream


def test_llava_hetero_memory_per_island():
    _, _, co_stage, co = _plan("llava_hetero")
    cfg, layouts, nc_stage, nc = _plan("llava_hetero", *NON_COLOCATED)
    roles = role_table(layouts, 64)
    enc = [m["total"] for m, r in zip(nc, roles) if r.modules == ("vision", "projector")]
    llm = [m["total"] for m, r in zip(nc, roles) if r.modules == ("llm",)]
    assert len(enc) == 16 and len(llm) == 48
    # an LLM island rank holds no encoder state: less memory than the colocated peak (its stage 0
    # holds 2 micro-batches of 20 layers in flight, the island's 3 of 13)
    assert max(llm) < max(m["total"] for m in co)
    assert max(enc) < min(llm)
    state = sum(getattr(nc_stage[m][0], k) for m in ("vision", "projector") for k in ("weights", "grads", "optimizer"))
    assert enc[0] * GIB == pytest.approx(state + nc_stage["vision"][0].activations + nc_stage["projector"][0].activations)
    # colocated: each dp64 lane encodes its 2 images (577 tokens each, 23 blocks) in phase 1
    assert co_stage["vision"][0].activations == int(23 * _vit_layer_bytes(2 * 577))
    # island: a micro-batch of 4096 x cp2 LLM tokens holds at most 14 images of 576 rows: the
    # lane's 8 images fit in one, so one micro-batch in flight
    assert nc_stage["vision"][0].activations == int(23 * _vit_layer_bytes(8 * 577))
    assert nc_stage["projector"][0].activations == int(8 * 576 * (1024 + 2 * 5120) * 2)


def test_colocated_phase3_recompute_is_not_added_to_the_llm_activations():
    _, _, stage, per_rank = _plan("llava_hetero", "vision.layout.recompute=full")
    assert not stage["vision"][0].held and not stage["projector"][0].held and stage["llm"][0].held
    enc = stage["vision"][0].activations + stage["projector"][0].activations
    assert stage["vision"][0].activations == int(23 * _vit_layer_bytes(2 * 577))  # the whole encoder
    assert per_rank[0]["activations"] * GIB == pytest.approx(max(stage["llm"][0].activations, enc))


def test_large_encoder_fits_colocated_only_with_its_state_sharded():
    _, _, _, sharded = _plan("internvit6b_llama70b")
    _, _, _, replicated = _plan("internvit6b_llama70b", "vision.layout.dp_shard=false")
    assert max(r["total"] for r in sharded) < 80 < 99 < min(r["total"] for r in replicated)


def test_plan_prints_memory_per_island_and_warns_of_encoder_recompute_it_cannot_run(tmp_path, capsys):
    from hcp.preflight.plan_mode import run_plan

    cfg = compose_config(["+recipe=llava_hetero", "mode=plan", *NON_COLOCATED, "vision.layout.recompute=full"])
    plan = run_plan(cfg, tmp_path)
    roles = {r["role"]: r for r in plan["memory_by_role"]}
    assert list(roles) == ["vision pp0, projector pp0", "llm pp0", "llm pp1", "llm pp2"]
    assert roles["vision pp0, projector pp0"]["ranks"] == 16 and roles["llm pp0"]["ranks"] == 16
    assert roles["llm pp0"]["max_gib"] == max(r["total"] for r in plan["memory_gib"])
    assert not [w for w in plan["warnings"] if "recompute" in w]  # full: per ViT block, as estimated
    assert "memory by role: vision pp0, projector pp0 (16 ranks)" in capsys.readouterr().out
    cfg = compose_config(["+recipe=llava_hetero", "mode=plan", *NON_COLOCATED, "vision.layout.recompute=selective"])
    warnings = run_plan(cfg, tmp_path / "selective")["warnings"]
    assert any("vision.layout.recompute=selective on an island" in w for w in warnings)
    assert [w for w in warnings if "training refuses" in w] == [
        "warning: training refuses this layout today: vision.layout.recompute='selective': selective "
        "recompute is implemented in the LLM's decoder layers only. Fix: use recompute=none or full"]


def test_projector_is_charged_on_the_last_encoder_stage_only():
    """On an island the projector runs on the encoder's last stage with its TP and DP
    (`hcp.plan.step.island_head`), so only those ranks carry its state and activations."""
    from hcp.preflight.plan_mode import running_layouts

    cfg, layouts, stage, per_rank = _plan("llava_hetero", *NON_COLOCATED, "vision.layout.pp=2",
                                          "vision.layout.pp_layers=[12,11]")
    proj = running_layouts(cfg, layouts)["projector"]
    assert (proj.rank_offset, proj.num_ranks, proj.dp, proj.pp) == (8, 8, 8, 1)
    roles = role_table(running_layouts(cfg, layouts), 64)
    assert roles[0].modules == ("vision",) and roles[8].modules == ("vision", "projector")
    state = lambda s: s.weights + s.grads + s.optimizer  # noqa: E731
    assert per_rank[0]["total"] * GIB == pytest.approx(state(stage["vision"][0]) + stage["vision"][0].activations)
    assert per_rank[8]["total"] * GIB == pytest.approx(state(stage["vision"][1]) + state(stage["projector"][0])
                                                       + stage["vision"][1].activations + stage["projector"][0].activations)
    # 16 images per lane (dp8), at most 14 per LLM micro-batch (4096 x cp2 / 576): 2 micro-batches,
    # both in flight on the last stage (pp - s + llm pp = 1 + 3 is more)
    assert stage["projector"][0].activations == int(2 * 14 * 576 * (1024 + 2 * 5120) * 2)
