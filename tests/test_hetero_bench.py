"""benchmarks/hetero.py runs end to end on a tiny configuration on 8 ranks (`--world 4`, issue
12's two layouts, runs the same code on fewer ranks): the homogeneous, colocated and
non-colocated layouts report the same loss,
the heterogeneous routes move exactly the minimum bytes, each rank encodes the images its
layout gives it, the pipeline figures come per island and stage, and --json has the keys of
issues 12 and 14."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import hetero  # noqa: E402
from bench_utils import run_benchmark  # noqa: E402

TINY = ["vision.image_size=8", "vision.patch_size=2", "vision.hidden_size=64", "vision.num_layers=2",
        "vision.num_heads=2", "vision.ffn_hidden_size=128", "llm.num_layers=2", "trainer.micro_batch_tokens=64"]


@pytest.mark.slow
def test_hetero_benchmark_three_layouts_on_8_ranks(tmp_path):
    path = tmp_path / "out" / "hetero.json"
    run_benchmark("hetero", ["--steps", "1", "--warmup", "0", "--text-tokens", "8", "--plan",
                             "none", "--json", str(path), *TINY])
    out = json.loads(path.read_text())
    layouts = out["layouts"]
    assert list(layouts) == ["homogeneous", "heterogeneous", "non_colocated"]
    homo, het, nc = layouts.values()
    for r in layouts.values():
        assert {"critical_path_s", "modeled_step_s", "step_wall_s", "tokens_per_s", "bubble",
                "llm_stage_busy_s", "llm_stage_balance", "encoder_flops_per_rank", "route_bytes",
                "route_min_bytes"} <= set(r)
        assert abs(r["loss"] - homo["loss"]) < 1e-5
        assert len(r["llm_stage_busy_s"]) == 2 and r["micro_batches"] > 1
        assert r["modeled_step_s"] >= max(r["llm_stage_busy_s"]) > 0
    assert homo["route_bytes"] == 0
    for r in (het, nc):
        assert r["route_bytes"] == r["route_min_bytes"] > 0
    # 16 samples of 1 or 2 images, 24 in all: homogeneous stage-0 ranks (tp2 x cp2) each encode
    # all of them, colocated dp8 lanes (blocks) 3 each, the dp4 island's lanes 24 in all, the
    # plan's within one sample's images of each other (`balanced_lanes`)
    assert homo["images_per_rank"] == [24] * 4 + [0] * 4 and het["images_per_rank"] == [3] * 8
    lanes = nc["images_per_rank"][:4]
    assert sum(lanes) == 24 and max(lanes) - min(lanes) <= 2 and nc["images_per_rank"][4:] == [0] * 4
    assert max(het["encoder_flops_per_rank"]) * 8 == pytest.approx(max(homo["encoder_flops_per_rank"]))
    assert set(nc["bubble"]) == {"vision", "llm"} and len(nc["bubble"]["llm"]) == 2
    assert set(het["bubble"]) == {"llm"} and all(0 <= b < 1 for b in het["bubble"]["llm"])
    # 384 image rows of 256 fp32: colocated, each to both TP ranks of its LLM shard and its
    # gradient back once; non-colocated (LLM tp1) once each way
    row = 256 * 4
    assert het["route_min_bytes_by_direction"] == [2 * 384 * row, 384 * row]
    assert nc["route_min_bytes_by_direction"] == [384 * row] * 2
    assert out["regime"].startswith("seed's finding") and "measured on CPU" in out["regime"]


@pytest.mark.slow
def test_plan_section_compares_placements_at_full_size(capsys):
    """The plan table of llava_hetero both ways: a non-colocated LLM rank holds no encoder state
    and less than a colocated one, the encoder island less still; both fit, colocated is faster
    (the LLM keeps all 64 ranks), which the regime summary calls headroom."""
    import hetero_plan

    out = hetero_plan.plan_section(hetero_plan.CASES[:2])
    co, nc = out["cases"]
    assert (co["placement"], nc["placement"]) == ("colocated", "non_colocated")
    assert co["encoder_rank_max_gib"] is None and nc["encoder_rank_max_gib"] < nc["llm_rank_max_gib"] < co["llm_rank_max_gib"]
    assert co["fits"] and nc["fits"] and co["step_s"] < nc["step_s"]
    assert "colocated wins" in out["conclusion"] and "llava_hetero" in capsys.readouterr().out
    assert "colocated wins with headroom" in hetero.regime_summary({"plan": out})
