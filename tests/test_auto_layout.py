"""`layout=auto` (hcp.preflight.auto_layout): pins respected, only feasible layouts returned, the
pruned search finds the brute-force optimum, selective recompute priced, a rehearsal report
taken only from this job, the report is written, and the CLI runs it.
Cost: about 5-6 minutes in all on 2 cores at load 7-11 (the brute-force and CLI runs are most
of it)."""
import copy
import json
import os
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from cfg_utils import REPO, compose_cfg
from hcp.config.errors import ConfigError
from hcp.config.validate import validate
from hcp.preflight.auto_cost import Scorer, combine_bounds
from hcp.preflight.auto_layout import (_but_recompute, apply_layout, check_candidate, choose_layout,
                                      dominates, search)
from hcp.preflight.auto_space import (combine, encoder_options, island_sizes, module_options, pinned_fields,
                                      placements)
from hcp.preflight.estimate import cost_model, lane_stage_times
from hcp.preflight.plan_mode import memory_per_rank
from hcp.preflight.rehearse.report import job_facts
from hcp.train.support import check_trainable
from hcp.config.specs import resolve_modules

SMALL = ["+recipe=llava_hetero", "mode=plan", "launcher.nnodes=1", "cluster.num_nodes=1",
         "trainer.global_batch_size=32"]
"""The 13B LLaVA on one node of 8 GPUs: both placements, memory matters, a few thousand points."""


def _cfg(overrides):
    cfg = compose_cfg(overrides)
    OmegaConf.resolve(cfg)
    return cfg


def _brute_force(cfg, world, pinned):
    """Every candidate of the space that fits, scored without pruning: [(candidate, score)]."""
    scorer = Scorer(cfg, world, cfg.packing_profile)
    node = min(int(cfg.cluster.gpus_per_node), world)
    out = []
    for placement in placements(cfg, pinned):
        for islands in ([()] if placement == "colocated" else island_sizes(cfg, world, node, pinned)):
            split = sum(islands)
            for v in encoder_options(scorer.cfg, placement, islands, pinned, node, world):
                for x in module_options(scorer.cfg, "llm", world - split, split, placement, pinned, node):
                    cand = combine(scorer.cfg, placement, v, x)
                    if cand is None or max(scorer.memory(cand).values()) > scorer.cap:
                        continue
                    score = scorer.score(cand)
                    bound = combine_bounds(placement, scorer.encoder_part(v, placement),
                                           min(scorer.llm_bound(x), scorer.llm_part(x)))
                    assert bound <= score.step_time_s * (1 + 1e-9), (cand, bound, score)
                    out.append((cand, score))
    return out


def test_pinned_fields_come_from_the_command_line_only():
    cfg = _cfg(["+recipe=llava_tiny_hetero", "llm.layout.pp_layers=[1,1]", "placement=colocated"])
    pins = pinned_fields(cfg, ["+recipe=llava_tiny_hetero", "llm.layout.pp_layers=[1,1]",
                               "placement=colocated", "trainer.max_steps=3"])
    assert pins == {"llm.layout.pp_layers": [1, 1], "llm.layout.pp": 2, "placement": "colocated"}


def test_search_finds_the_brute_force_optimum_and_its_bounds_hold():
    cfg = _cfg(SMALL)
    every = _brute_force(cfg, 8, {})
    assert len(every) > 100
    best = min(s.step_time_s for _, s in every)
    result = search(cfg, 8, {})
    assert result.ranked[0][1].step_time_s == pytest.approx(best, rel=1e-12)
    assert result.counts["scored"] < len(every)  # it pruned
    steps = [s.step_time_s for _, s in result.ranked]
    assert steps == sorted(steps) and len(steps) == 10
    twins = {}  # `dominates` compares only layouts equal but for recompute: group them first
    for a in every:
        twins.setdefault(repr(_but_recompute(a[0])), []).append(a)
    kept = [a for a in every  # LLM selective: none's memory, slower
            if not any(dominates(b, a) for b in twins[repr(_but_recompute(a[0]))])]
    assert len(kept) < len(every) and not any(dominates(a, b) for a in result.ranked for b in result.ranked)
    assert all(c.by_module["llm"].recompute != "selective" for c, _ in result.ranked)
    assert steps == pytest.approx(sorted(s.step_time_s for _, s in kept)[:10], rel=1e-12)


def test_selective_recompute_costs_the_attention_cores_forward_and_saves_no_memory():
    # the 13B LLM on one lane (tp 8, pp 1): selective's step is none's plus each micro-batch's
    # attention forward (at cp 1 the core is its scores), at none's memory, so `dominates` drops it
    scorer = Scorer(_cfg(SMALL), 8, "h100")
    enc = encoder_options(scorer.cfg, "colocated", (), {}, 8, 8)[0]
    pins = {"llm.layout.tp": 8, "llm.layout.pp": 1, "llm.layout.dp_shard": False}
    llm = {lay.recompute: lay for lay in module_options(scorer.cfg, "llm", 8, 0, "colocated", pins, 8)}
    cands = {r: combine(scorer.cfg, "colocated", enc, llm[r]) for r in ("none", "selective")}
    none, sel = ((cands[r], scorer.score(cands[r])) for r in ("none", "selective"))
    cost = cost_model(scorer.cfg, llm["none"], scorer.hw)
    (plan, _, _), = lane_stage_times(scorer.cfg, llm["none"], cost, scorer.lens)  # one lane
    attention = 0.0
    for mb in (mb for r in plan.rounds for g in r.groups for mb in g.micro_batches):
        x = scorer.lens[list(mb)].astype(float)
        attention += float(cost.fwd(x.sum(), (x ** 2).sum(), 1)[0] - cost.fwd(x.sum(), 0.0, 1)[0])
    assert attention > 0 and sel[1].memory_gib == none[1].memory_gib
    assert sel[1].llm_s - none[1].llm_s == pytest.approx(attention, rel=1e-9)
    assert sel[1].step_time_s - none[1].step_time_s == pytest.approx(attention, rel=1e-9)
    assert dominates(none, sel) and not dominates(sel, none)


def test_search_respects_pins_and_returns_only_feasible_layouts():
    over = [*SMALL, "llm.layout.tp=2", "placement=non_colocated", "cluster.device_memory_gib=60"]
    cfg = _cfg(over)
    pins = pinned_fields(cfg, over)
    result = search(cfg, 8, pins)
    every = _brute_force(cfg, 8, pins)
    assert result.ranked[0][1].step_time_s == pytest.approx(min(s.step_time_s for _, s in every), rel=1e-12)
    for cand, score in result.ranked:
        lays = cand.by_module
        assert cand.placement == "non_colocated" and lays["llm"].tp == 2
        trial = copy.deepcopy(cfg)
        apply_layout(trial, cand)
        layouts = validate(trial, 8)          # every rule, as training runs them
        check_trainable(trial, resolve_modules(trial, layouts))
        assert layouts == lays
        plan_mem = max(r["total"] for r in memory_per_rank(trial, layouts, 8))   # plan mode's memory
        assert plan_mem == pytest.approx(max(score.memory_gib.values()), rel=1e-9) and plan_mem <= 60


def test_layouts_training_refuses_are_never_ranked():
    # llm pp 2 is a valid layout, but tied embeddings across LLM stages do not train
    # (hcp.train.support): the search returns none of them and names the refusing field (every
    # candidate is checked: the encoder pinned small)
    cfg = _cfg(["+recipe=llava_tiny_hetero", "mode=plan", "llm.tie_embeddings=true"])
    with pytest.raises(ConfigError, match="llm.tie_embeddings=True"):
        search(cfg, 4, {"llm.layout.recompute": "none", "llm.layout.pp": 2, "vision.layout.tp": 1,
                        "vision.layout.cp": 1, "vision.layout.recompute": "none"})


def test_no_layout_fits_names_the_field():
    cfg = _cfg([*SMALL, "cluster.device_memory_gib=1"])
    with pytest.raises(ConfigError, match="layout='auto'.*cluster.device_memory_gib=1"):
        search(cfg, 8, {})
    with pytest.raises(ConfigError, match=r"layout='auto': the pinned fields \{'llm.layout.tp': 3\} leave no candidate"):
        search(_cfg([*SMALL, "llm.layout.tp=3"]), 8, {"llm.layout.tp": 3})


def test_choose_layout_writes_the_winner_and_the_report(tmp_path):
    cfg = _cfg(["+recipe=llava_tiny_hetero", "mode=plan"])
    report = choose_layout(cfg, ["+recipe=llava_tiny_hetero", "mode=plan"], 4, tmp_path, verbose=False)
    saved = json.loads((tmp_path / "auto_layout.json").read_text())
    win = saved["ranked"][0]
    assert saved["ranked"] == report["ranked"] and 1 <= len(saved["ranked"]) <= 10
    assert {"step_time_s", "tflops_per_gpu", "memory_gib", "bubble_fraction", "route_bytes"} <= set(win)
    assert "step_time_s" in saved["given"] and "critical path" in saved["why"]
    assert cfg.placement == win["placement"]
    for m, lay in win["layouts"].items():
        assert {k: cfg[m].layout[k] for k in ("tp", "cp", "pp")} == {k: lay[k] for k in ("tp", "cp", "pp")}


def test_plan_mode_and_layout_auto_price_the_same_layout_alike(tmp_path, capsys, monkeypatch):
    """One pricing of a step (`hcp.preflight.auto_cost.price_step`): plan mode's estimate of the
    recipe's layout equals layout=auto's `given` row (step, TFLOPS, bubble), and both state the
    batch they priced (the recipe's own data) and the hardware profile; a training run on a
    machine without a GPU is told that H100 figures are not its own."""
    from hcp.preflight.plan_mode import run_plan

    overrides = ["+recipe=llava_tiny_hetero", "mode=plan"]
    plan = run_plan(_cfg(overrides), tmp_path)["estimate"]
    world = plan_world(tmp_path)
    given = choose_layout(_cfg(overrides), overrides, world, None, verbose=False)["given"]
    for key in ("step_time_s", "tflops_per_gpu", "bubble_fraction"):
        assert plan[key] == given[key], key
    out = capsys.readouterr().out
    assert "the batch priced: " in plan["priced_on"] and "data.name=digits_vqa" in plan["priced_on"]
    assert "hardware profile packing_profile=h100" in out and "no GPU" not in out
    monkeypatch.setattr("hcp.launch.launch.cuda_device_count", lambda: 0)
    choose_layout(_cfg(["+recipe=llava_tiny_hetero"]), [], 4, None, verbose=True)
    assert "this machine has no GPU, so they are not this CPU run's" in capsys.readouterr().out


def plan_world(run_dir) -> int:
    return json.loads((run_dir / "plan.json").read_text())["world_size"]


def _cli(tmp_path, *overrides):
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "mode=plan", "layout=auto",
                           f"hydra.run.dir={tmp_path}", *overrides], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads((tmp_path / "auto_layout.json").read_text()), \
        json.loads((tmp_path / "plan.json").read_text())


def test_cli_plan_tiny(tmp_path):
    out, auto, plan = _cli(tmp_path, "+recipe=llava_tiny_hetero")
    assert "hcp: layout=auto chose" in out and "given" in out
    win = auto["ranked"][0]
    assert plan["placement"] == win["placement"]
    assert {m: {k: v[k] for k in ("tp", "cp", "pp", "dp")} for m, v in win["layouts"].items()} == \
        {m: {k: v["layout"][k] for k in ("tp", "cp", "pp", "dp")} for m, v in plan["modules"].items()}


def test_cli_plan_full_size_with_a_pin_beats_the_recipe(tmp_path):
    out, auto, plan = _cli(tmp_path, "+recipe=llava_hetero", "llm.layout.tp=8")
    assert all(r["layouts"]["llm"]["tp"] == 8 for r in auto["ranked"])
    assert auto["pinned"] == {"llm.layout.tp": 8}
    assert plan["modules"]["llm"]["layout"]["tp"] == 8
    assert auto["ranked"][0]["tflops_per_gpu"] >= auto["given"]["tflops_per_gpu"]


TINY8 = ["+recipe=llava_tiny_hetero", "mode=plan", "launcher.nproc_per_node=8"]
CPU_PROFILE = os.path.join(REPO, "benchmarks", "cpu_profile.yaml")


def test_the_estimate_prices_the_runs_own_data():
    # the digits' samples are ~68 tokens; a longer system prompt makes them longer, and the
    # priced batch follows (the built-in Wikipedia sample would give both the same batch)
    short = _cfg([*TINY8, "data.max_seq_len=512"])
    long = _cfg([*TINY8, "data.max_seq_len=512", "data.system_prompt=" + "an assistant. " * 16])
    a, b = Scorer(short, 8, "h100"), Scorer(long, 8, "h100")
    assert a.lengths_from == "data.name=digits_vqa" and 60 < a.lens.mean() < 80
    assert b.lens.mean() > a.lens.mean() + 200 and b.llm_flops > 3 * a.llm_flops
    result = search(long, 8, {})
    assert result.lengths_from == "data.name=digits_vqa" and list(result.lengths) == list(b.lens)


def test_data_missing_here_falls_back_to_the_built_in_sample():
    cfg = _cfg([*SMALL, "data=llava_json", "data.path=/nonexistent/llava.json"])
    scorer = Scorer(cfg, 8, "h100")
    assert scorer.lengths_from.startswith("the built-in length sample") and len(scorer.lens) == 32


def test_ranks_sharing_few_cores_are_priced_by_their_total_work(tmp_path):
    # 8 CPU ranks on a host of half a core: the step is all ranks' CPU work over the cores, so
    # islands (each module on 4 ranks: half the per-rank layer calls) beat colocated, and CP's
    # collectives cost work too
    text = re.sub(r"\n  (stacked_cores|spread_s): .*", "", open(CPU_PROFILE).read())
    flat = tmp_path / "flat.yaml"
    flat.write_text(re.sub(r"cores: .*", "cores: 0.5", text))
    cfg = _cfg([*TINY8, f"packing_profile={flat}"])
    pins = {"vision.layout.tp": 1, "vision.layout.pp": 1, "llm.layout.tp": 1, "llm.layout.pp": 1,
            "llm.layout.recompute": "none"}
    result = search(cfg, 8, pins, top=100)
    assert {c.placement for c, _ in result.ranked} == {"colocated", "non_colocated"}
    for _, s in result.ranked:
        assert s.stacked_s == 0 and s.critical == "host"
        assert s.step_time_s == pytest.approx(s.work_s / 0.5, rel=1e-12)
    best = result.ranked[0][0].by_module
    assert result.ranked[0][0].placement == "non_colocated" and best["llm"].cp == 1
    # stacked cores: a rank's micro-batch at cp 1 is one long stretch, under CP one per layer
    # call (its collectives block in every layer), so CP runs far less of its work stacked
    stacked = tmp_path / "stacked.yaml"
    stacked.write_text(re.sub(r"cores: .*", "cores: 0.5\n  stacked_cores: 0.1\n  spread_s: 0.05", text))
    scorer = Scorer(cfg, 8, str(stacked), result.lengths)
    by_key = {}  # (placement, encoder layout, LLM dp x cp) -> {cp: (candidate, score)}
    for cand, flat_score in result.ranked:
        llm = cand.by_module["llm"]
        by_key.setdefault((cand.placement, cand.by_module["vision"], llm.dp * llm.cp), {})[llm.cp] = (cand, flat_score)
    pairs = []
    for by_cp in [v for v in by_key.values() if {1, 2} <= set(v)][:4]:
        share = {}
        for cp in (1, 2):
            cand, flat_score = by_cp[cp]
            s = scorer.score(cand)
            assert s.work_s == pytest.approx(flat_score.work_s, rel=1e-12) and 0 < s.stacked_s < s.work_s
            assert s.step_time_s == pytest.approx((s.work_s - s.stacked_s) / 0.5 + s.stacked_s / 0.1, rel=1e-12)
            share[cp] = s.stacked_s / s.work_s
        pairs.append((share[1], share[2]))
    assert pairs and all(cp2 < cp1 for cp1, cp2 in pairs)


def test_the_search_on_a_host_finds_the_brute_force_optimum():
    cfg = _cfg([*TINY8, f"packing_profile={CPU_PROFILE}", "llm.layout.recompute=none"])
    pins = {"llm.layout.recompute": "none"}
    every = _brute_force(cfg, 8, pins)  # asserts every bound too
    result = search(cfg, 8, pins)
    assert result.ranked[0][1].step_time_s == pytest.approx(min(s.step_time_s for _, s in every), rel=1e-12)


def test_a_bad_host_entry_names_the_profile(tmp_path):
    bad = tmp_path / "cpu.yaml"
    bad.write_text(re.sub(r"cores: .*", "cores: 0", open(CPU_PROFILE).read()))
    with pytest.raises(ConfigError, match="packing_profile.*host.*cores"):
        Scorer(_cfg([*TINY8, f"packing_profile={bad}"]), 8, str(bad))


def test_projector_pins_hold_the_encoders_fields_and_others_are_refused():
    over = ["+recipe=llava_tiny_hetero", "mode=plan", "projector.layout.tp=2", "projector.layout.cp=2"]
    cfg = _cfg(over)
    result = search(cfg, 4, pinned_fields(cfg, over))
    assert result.ranked and all((c.by_module[m].tp, c.by_module[m].cp) == (2, 2)
                                 for c, _ in result.ranked for m in ("vision", "projector"))
    with pytest.raises(ConfigError, match="projector.layout.pp.*runs with its encoder"):
        search(cfg, 4, {"projector.layout.pp": 2})


def _passes(cfg, cand, world) -> bool:
    try:
        check_candidate(cfg, cand, world)
        return True
    except ConfigError:
        return False


def _assert_trains(cfg, cand, score, world):
    """`cand` passes every rule as training runs them, and plan mode's memory is the score's."""
    trial = copy.deepcopy(cfg)
    apply_layout(trial, cand)
    layouts = validate(trial, world)
    check_trainable(trial, resolve_modules(trial, layouts))
    assert layouts == cand.by_module
    plan_mem = max(r["total"] for r in memory_per_rank(trial, layouts, world))
    assert plan_mem == pytest.approx(max(score.memory_gib.values()), rel=1e-9) and plan_mem <= cfg.cluster.device_memory_gib


def test_named_encoders_are_searched_with_their_pins_held():
    # two encoders, each with its projector: both placements, each encoder's tp/cp/recompute
    # searched, vision2's tp pinned; the pruned search finds the brute-force optimum
    over = ["+recipe=llava_tiny_two_encoders", "mode=plan", "encoders.vision2.layout.tp=2"]
    cfg = _cfg(over)
    pins = pinned_fields(cfg, over)
    assert pins == {"encoders.vision2.layout.tp": 2}
    every = _brute_force(cfg, 4, pins)
    assert {c.placement for c, _ in every} == {"colocated", "non_colocated"}
    assert {c.by_module["vision"].cp for c, _ in every} == {1, 2, 4}
    result = search(cfg, 4, pins)
    assert result.ranked[0][1].step_time_s == pytest.approx(min(s.step_time_s for _, s in every), rel=1e-12)
    for cand, score in result.ranked:
        lays = cand.by_module
        assert lays["vision2"].tp == lays["projector2"].tp == 2 and lays["projector2"].cp == lays["vision2"].cp
        _assert_trains(cfg, cand, score, 4)


def test_encoder_cp_is_searched_and_wins_where_the_batch_leaves_no_dp():
    # InternViT (25 heads: tp 1) on 8 ranks with 8 images per step: encoder DP alone leaves ranks
    # idle, encoder CP splits every image; the pruned search finds the brute-force optimum
    over = ["+recipe=internvl_tiles_cp", "mode=plan", "launcher.nnodes=1", "cluster.num_nodes=1",
            "trainer.global_batch_size=4", "data.images_per_sample=2"]
    cfg = _cfg(over)
    every = sorted(_brute_force(cfg, 8, {}), key=lambda item: item[1].step_time_s)
    best = next(s for c, s in every if _passes(cfg, c, 8))
    result = search(cfg, 8, {})
    assert result.ranked[0][1].step_time_s == pytest.approx(best.step_time_s, rel=1e-12)
    assert result.ranked[0][0].by_module["vision"].cp > 1
    no_cp = next(s for c, s in every if c.by_module["vision"].cp == 1 and _passes(cfg, c, 8))
    assert no_cp.step_time_s > 1.05 * best.step_time_s
    for cand, score in result.ranked:
        _assert_trains(cfg, cand, score, 8)


def _report(path, roles, facts, **job):
    path.write_text(json.dumps({"job": {**facts, "placement": "colocated", "layouts": {}, "ranks": [0], **job},
                                "roles": roles, "ranks": {"0": {"error": None}}}))


def test_a_rehearsal_report_corrects_every_memory_estimate(tmp_path):
    """`rehearse.report`: each estimate times the report's largest tracked / plan ratio (never
    below 1), and the search prunes on the corrected figure; a missing report names the key."""
    report = tmp_path / "rehearsal.json"
    facts = job_facts(_cfg(SMALL), resolve_modules(_cfg(SMALL)), 8)
    _report(report, [{"peak_gib": 30.0, "plan_gib": 25.0}, {"peak_gib": 10.0, "plan_gib": 20.0}], facts)
    plain = Scorer(_cfg(SMALL), 8, "h100")
    corrected = Scorer(_cfg([*SMALL, f"rehearse.report={report}"]), 8, "h100")
    ranked = [c for c, _ in search(_cfg(SMALL), 8, {}).ranked]
    for cand in ranked:
        assert corrected.memory(cand) == pytest.approx({k: 1.2 * v for k, v in plain.memory(cand).items()})
    peaks = sorted(max(plain.memory(c).values()) for c in ranked)
    cap = (peaks[0] + peaks[-1]) / 2 * 1.2  # between the corrected peaks: some ranked layouts no longer fit
    assert peaks[0] < peaks[-1]
    fits = search(_cfg([*SMALL, "layout=auto", f"cluster.device_memory_gib={cap}", f"rehearse.report={report}"]), 8, {})
    assert fits.counts["memory_correction"] == pytest.approx(1.2)
    assert all(max(corrected.memory(c).values()) <= cap for c, _ in fits.ranked)
    assert any(max(corrected.memory(c).values()) > cap for c in ranked)
    _report(report, [{"peak_gib": 10.0, "plan_gib": 20.0}], facts)
    assert Scorer(_cfg([*SMALL, f"rehearse.report={report}"]), 8, "h100").correction == 1.0
    with pytest.raises(ConfigError, match="rehearse.report=.*no such file"):
        Scorer(_cfg([*SMALL, f"rehearse.report={tmp_path}/none.json"]), 8, "h100")
    for text, why in (("not json", "not JSON"), ("[1, 2]", "records no job")):
        report.write_text(text)
        with pytest.raises(ConfigError, match=f"rehearse.report=.*{why}"):
            Scorer(_cfg([*SMALL, f"rehearse.report={report}"]), 8, "h100")
    _report(report, [], facts)
    with pytest.raises(ConfigError, match="rehearse.report=.*no role with"):
        Scorer(_cfg([*SMALL, f"rehearse.report={report}"]), 8, "h100")
    with pytest.raises(ConfigError, match="rehearse.report=.*not a file"):
        Scorer(_cfg([*SMALL, f"rehearse.report={tmp_path}"]), 8, "h100")


@pytest.mark.parametrize("job, said", [
    ({"world_size": 64}, "it rehearsed world_size=64, this run has world_size=8"),
    ({"llm.hidden_size": 4096}, "it rehearsed llm.hidden_size=4096, this run has llm.hidden_size=5120"),
    ({"precision": "fp32"}, "it rehearsed precision='fp32', this run has precision='bf16'"),
    ({"encoders.vision2.hidden_size": 64}, "it rehearsed encoders.vision2.hidden_size=64, this run has "
                                           "no encoders.vision2.hidden_size"),
    ({"vision.freeze": True}, "it rehearsed vision.freeze=True, this run has vision.freeze=False")])
def test_another_jobs_rehearsal_report_is_refused_naming_what_differs(tmp_path, job, said):
    cfg = _cfg([*SMALL, f"rehearse.report={tmp_path / 'r.json'}"])
    facts = job_facts(cfg, resolve_modules(cfg), 8)
    _report(tmp_path / "r.json", [{"peak_gib": 30.0, "plan_gib": 25.0}], facts)
    assert Scorer(cfg, 8, "h100").correction == pytest.approx(1.2)  # its own report is taken
    _report(tmp_path / "r.json", [{"peak_gib": 30.0, "plan_gib": 25.0}], facts, **job)
    with pytest.raises(ConfigError, match=re.escape(f"another job's rehearsal: {said}. Fix: rehearse this run")):
        Scorer(cfg, 8, "h100")


def test_a_rehearsal_report_with_a_raised_rank_or_without_layout_auto_is_refused(tmp_path):
    cfg = _cfg([*SMALL, f"rehearse.report={tmp_path / 'r.json'}"])
    facts = job_facts(cfg, resolve_modules(cfg), 8)
    (tmp_path / "r.json").write_text(json.dumps({"job": facts, "roles": [{"peak_gib": 3.0, "plan_gib": 2.0}],
                                                 "ranks": {"0": {"error": None}, "5": {"error": "Traceback"}}}))
    with pytest.raises(ConfigError, match="rank 5 raised in that rehearsal"):
        Scorer(cfg, 8, "h100")
    # layout=manual would ignore it: refused before anything runs; layout=auto validates
    given = [*TINY8, f"rehearse.report={tmp_path / 'r.json'}"]
    with pytest.raises(ConfigError, match=r"rehearse.report=.*only layout=auto reads it.*Fix: add layout=auto"):
        validate(_cfg(given), 8)
    validate(_cfg([*given, "layout=auto"]), 8)


def test_the_benchmark_defaults_to_the_readme_tables_rounds_and_calibrates_on_the_fits_own(monkeypatch):
    # benchmarks/auto_layout.py: docs/planning.md's table is --rounds 4; --calibrate --reuse reads
    # back the 2 rounds cpu_profile.yaml was fitted on (more would train the missing rounds anew)
    import importlib.util

    path = os.path.join(REPO, "benchmarks", "auto_layout.py")
    spec = importlib.util.spec_from_file_location("auto_layout_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rounds = []

    def stop(*args):
        rounds.append(args[-1].rounds)
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "calibrate", stop)
    monkeypatch.setattr(bench, "run_variant", stop)
    for argv in ([], ["--calibrate", "--reuse"], ["--rounds", "3"]):
        with pytest.raises(KeyboardInterrupt):
            bench.main(argv)
    assert rounds == [4, 2, 3]
    planning = open(os.path.join(REPO, "docs", "planning.md")).read()
    benchmarks = open(os.path.join(REPO, "docs", "benchmarks.md")).read()
    assert "The table is the default 4 rounds (`--rounds 4`" in planning
    assert "x 4 rounds on 8 CPU ranks" in benchmarks
    assert "(2 rounds of 2 warm-up" in open(os.path.join(REPO, "benchmarks", "cpu_profile.yaml")).read()
