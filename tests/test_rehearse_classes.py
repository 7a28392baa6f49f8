"""The class rehearsal (`rehearse.by_class=true`, hcp.preflight.rehearse.classes): one rank per
class rehearsed, every other rank's trace derived by renaming groups and peers, equals an
all-rank rehearsal op by op; a fault in a representative is still caught; a rank whose plan
differs is its own class."""
from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from tests.cfg_utils import compose_cfg, with_specs
from tests.rehearse_utils import rehearse

WORLD = ("launcher.nproc_per_node=8",)
DYNAMIC = ("+recipe=llama_tiny", *WORLD, "packing=dynamic_cp", "llm.layout.cp=2", "llm.layout.tp=2",
           "trainer.micro_batch_tokens=128")
"""TP 2 x a dynamic-CP pool of 4: each pool position its own class, TP pairs derived."""
COLOCATED = ("+recipe=llava_tiny_hetero", *WORLD, "llm.layout.tp=4", "llm.layout.cp=1", "llm.num_kv_heads=4")
"""TP 4 x DP 2 beside a DP 8 encoder side: each lane's rows return their gradient from TP rank 0
of the LLM (`RankRoute.grad_owner`), so per DP replica TP rank 0 is one class, TP ranks 1-3 another
(at TP 2 every rank is its own class)."""


def _setup(tmp_path, overrides):
    from hcp.config.layouts import resolve_layouts
    from hcp.config.validate import validate
    from hcp.data.build import prepare_data
    from hcp.preflight.rehearse.runner import rehearsal_config

    cfg = compose_cfg(["mode=rehearse", "logger=none", "rehearse.steps=1", "trainer.global_batch_size=8",
                       *overrides], run_dir=str(tmp_path))
    validate(cfg, 8)
    list(prepare_data(*with_specs(cfg)))
    return rehearsal_config(cfg), resolve_layouts(cfg, 8)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("overrides", [DYNAMIC, COLOCATED], ids=["llama_tiny_dynamic_cp", "llava_tiny_hetero"])
def test_derived_traces_equal_an_all_rank_rehearsal(tmp_path, overrides):
    from hcp.preflight.rehearse import derive_world, world_classes
    from hcp.preflight.rehearse.report import find_mismatches
    from hcp.preflight.rehearse.runner import rehearse_ranks

    cfg, layouts = _setup(tmp_path, overrides)
    classes = world_classes(cfg, layouts, 8, 2)
    assert 1 < len(classes) < 8 and sorted(r for c in classes for r in c.members) == list(range(8))
    every = rehearse_ranks(cfg, str(tmp_path), list(range(8)), 8, 1, 2)
    derived, faults = derive_world({c.rep: every[c.rep] for c in classes}, classes, layouts, 8)
    assert faults == [] and find_mismatches(every, 8, 80) == find_mismatches(derived, 8, 80) == []
    for r in range(8):
        assert derived[r].ops == every[r].ops, r  # op by op: groups, names, peers, splits
        assert (derived[r].peak_bytes, derived[r].flops) == (every[r].peak_bytes, every[r].flops), r


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_fault_in_a_representative_is_caught_and_reported(monkeypatch, tmp_path):
    """Rank 5 (representative of ranks 5-7) skips the encoder's gradient sync: every rank of its
    class misses the all-reduce. The report counts rehearsed and derived ranks."""
    import hcp.train.encoders as sides

    sync = sides.sync_encoder_grads
    monkeypatch.setattr(sides, "sync_encoder_grads", lambda *a: None if dist.get_rank() == 5 else sync(*a))
    found = rehearse(monkeypatch, tmp_path, (*COLOCATED, "rehearse.by_class=true"))
    (bad,) = [m for m in found if m.what == "collective"]
    assert bad.ranks == [0, 5, 6, 7] and bad.step == 1 and bad.sides[6].startswith("nothing")
    report = json.load(open(tmp_path / "rehearsal.json"))
    assert report["classes"] == {"0": [0], "1": [1, 2, 3], "4": [4], "5": [5, 6, 7]}
    assert [report["ranks"][str(r)]["derived_from"] for r in range(8)] == [None, None, 1, 1, None, None, 5, 5]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_rank_whose_plan_differs_is_its_own_class_and_caught(monkeypatch, tmp_path):
    """Rank 6 plans with twice the token cap (its pool position's TP pair is 6, 7): computed on
    rank 6 itself, its plan slice differs, so it is rehearsed, and its collectives mismatch."""
    import hcp.train.planner as planner

    plan = planner.plan_step
    monkeypatch.setattr(planner, "plan_step", lambda sizes, layouts, packing, cap, *a, **k: plan(
        sizes, layouts, packing, cap * 2 if dist.get_rank() == 6 else cap, *a, **k))
    found = rehearse(monkeypatch, tmp_path, (*DYNAMIC, "rehearse.by_class=true"))
    classes = json.load(open(tmp_path / "rehearsal.json"))["classes"]
    assert classes["6"] == [6] and "7" in classes
    bad = [m for m in found if m.what == "collective"]
    assert bad and all(6 in m.ranks for m in bad)
