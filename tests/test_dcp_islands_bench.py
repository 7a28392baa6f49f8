"""benchmarks/dcp_islands.py's encoder model and bounds, on recorded facts (no ranks): the
calibration recovers, per ViT width, the per-FLOP and per-layer-call seconds that made the DP
islands' rank times; each encoder row's bound is the DP island's modelled time over the new
layout's work spread evenly at the model's unit costs (as the LLM row: the baseline's model over
the new layout's lower bound under that model), its floor bound the DP island's measured time over
the new layout's floor (the same means at the floor's unit costs), so a layout measured at its
model never beats either; `encoder_work` charges a CP rank its padded chunk and the gathered K/V."""
import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from hcp.model.flops import encoder_flops

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("dcp_islands", ROOT / "benchmarks/dcp_islands.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

PER_FLOP, PER_CALL = 1 / 1.5e11, 0.02          # the "machine" that made the DP rank times (narrow ViT)
WIDE_CALL = 0.05                                 # a wide ViT's layer call costs more
FLOOR_UNITS = [0.8 * PER_FLOP, 0.8 * PER_CALL]   # measured alone: cheaper than in the island
PER_BYTE, CP_CALL = 1 / 3e8, {1: 0.0, 2: 0.005, 4: 0.007}   # s per K/V byte, s per CP attention call (by CP size)
SYNC = {1: 0.05, 7: 0.3}                          # s per step's gradient sum, by ViT width


def _work(flops_per_lane, cp: int, calls: int):
    """[steps, 4 ranks, 4] encoder_work columns of a layout with lanes of these FLOPs."""
    steps = []
    for lanes in flops_per_lane:
        rows = []
        for f in lanes:   # each lane's cp ranks split its FLOPs and gather K/V
            rows += [[f / cp, 1e6 * f / 1e10 * (cp - 1), calls, calls * 4 / 6 * (cp > 1)]] * cp
        steps.append(rows)
    return np.array(steps)


def _results(dp_lanes):
    """Facts of the six layouts: every rank's time made by PER_FLOP and PER_CALL (WIDE_CALL for
    the wide ViT), the CP layouts measured exactly at their model, the floor's unit costs
    measured at the model's."""
    out = {}
    for name, cp, wide in (("static", 1, 1), ("dynamic", 1, 1), ("encoder_cp2", 2, 1), ("encoder_cp4", 4, 1),
                           ("wide_dp4", 1, 7), ("wide_cp4", 4, 7)):
        lanes = [[wide * sum(l)] if cp == 4 else [l[0] + l[1], l[2] + l[3]] if cp == 2 else
                 [wide * f for f in l] for l in dp_lanes]
        work = _work(lanes, cp, 18)
        coef = np.array([PER_FLOP, PER_BYTE, PER_CALL if wide == 1 else WIDE_CALL, CP_CALL[cp]])
        busy = work @ coef + SYNC[wide]                                # [steps, ranks]
        out[name] = {"critical_s": {"llm": 1.0, "vision": float(np.median(busy.max(1)))},
                     "vision_busy_s": busy.T.tolist(),
                     "model": {"llm": {"critical": 1.0, "bound": 0.8},
                               "vision": {"work": work.tolist(), "cp": cp,
                                          "floor_units": FLOOR_UNITS, "kv_units": [PER_BYTE, CP_CALL[cp]],
                                          "sync_s": SYNC[wide],
                                          "width": 384 * wide}}}
    return out


@pytest.mark.parametrize("dp_lanes, cp_wins", [
    ([[1e10, 1.2e10, 0.9e10, 1.1e10], [2e10, 1e10, 1.5e10, 1e10], [1e10, 1e10, 1.3e10, 1.2e10]], False),
    ([[1e11, 1e10, 1e10, 1e10], [1.2e11, 2e10, 1e10, 1e10], [9e10, 1e10, 2e10, 1e10]], True)])
def test_encoder_bounds_are_the_dp_time_over_the_layouts_mean_rank(dp_lanes, cp_wins, capsys):
    results = _results(dp_lanes)
    fits = bench.calibrate(results)
    assert np.allclose([fits[384], fits[7 * 384]], [(PER_FLOP, PER_CALL), (PER_FLOP, WIDE_CALL)], rtol=1e-6)
    rows = bench.report(results)
    assert "floor bound: the DP-4 island" in capsys.readouterr().out
    for what, base, new, cp in (("encoder CP 2 x DP 2 vs DP 4 (vision island)", "dynamic", "encoder_cp2", 2),
                                ("encoder CP 4 vs DP 4 (vision island)", "dynamic", "encoder_cp4", 4),
                                ("wide ViT: encoder CP 4 vs DP 4 (vision)", "wide_dp4", "wide_cp4", 4)):
        dp = results[base]["critical_s"]["vision"]
        dp_model = results[base]["model"]["vision"]["modelled_s"]
        work = np.asarray(results[new]["model"]["vision"]["work"])
        sync = results[new]["model"]["vision"]["sync_s"]
        unit = np.array([FLOOR_UNITS[0], PER_BYTE, FLOOR_UNITS[1], CP_CALL[cp]])
        model = np.array([PER_FLOP, PER_BYTE, PER_CALL if base == "dynamic" else WIDE_CALL, CP_CALL[cp]])
        floor = float(np.median(work.mean(1) @ unit)) + sync
        mean_rank = float(np.median(work.mean(1) @ model)) + sync
        row = rows[what]
        assert dp_model == pytest.approx(dp)                        # DP measured at its model
        assert row["bound"] == pytest.approx(dp_model / mean_rank)
        assert row["floor_bound"] == pytest.approx(dp / floor)
        assert row["modelled"] == pytest.approx(row["measured"])   # measured at the model
        assert row["measured"] <= row["bound"] * (1 + 1e-9)        # never beats its bound
        assert row["bound"] < row["floor_bound"]                    # the floor's units are cheaper
        assert row["measured_over_floor_bound"] < 1
    # one lane: every rank the same work, so the model's most loaded rank is its mean rank
    cp4 = rows["encoder CP 4 vs DP 4 (vision island)"]
    assert cp4["measured_over_bound"] == pytest.approx(1.0)
    cp2 = rows["encoder CP 2 x DP 2 vs DP 4 (vision island)"]   # two unequal lanes: below
    assert cp2["measured_over_bound"] < 1
    assert (cp4["floor_bound"] > 1) == cp_wins


@pytest.mark.timeout(120)
def test_encoder_work_charges_each_cp_rank_its_chunk_and_the_gathered_kv(tmp_path):
    data = bench.make_records(str(tmp_path), 32)
    args = argparse.Namespace(samples=16, micro_batch_tokens=256, overrides=[], warmup=0, steps=1)
    works = {}
    for name in ("dynamic", "encoder_cp4"):
        cfg, layouts = bench.layout_config(name, data, args, str(tmp_path / name))
        works[name] = np.asarray(bench.layout_model(cfg, layouts, args)["vision"]["work"][0])
    dp, cp = works["dynamic"], works["encoder_cp4"]
    assert (dp[:, 1] == 0).all() and (dp[:, 3] == 0).all()
    # 37 tokens per image: CP 4 ranks hold k = 10 positions each, 40 / 37 of the FLOPs in all
    assert cp[:, 0].sum() == pytest.approx(dp[:, 0].sum() * 40 / 37)
    assert np.ptp(cp, axis=0).max() == 0          # one lane: every rank the same work
    images = dp[:, 0].sum() / encoder_flops(cfg.vision, cfg.llm.hidden_size, 1.0)
    v = cfg.vision   # per image and block: K and V gathered from 3 peers, their gradients back
    assert cp[0, 1] == pytest.approx(images * 4 * 2 * 3 * 10 * 2 * v.hidden_size * 4)
    assert cp[0, 2] == cp[0, 3] * 6 / 4 >= dp[:, 2].max()   # every micro-batch on every rank


def test_floor_units_take_each_ranks_least_round_and_recover_the_unit_costs():
    """`floor_units` on rounds made by known unit costs, one exact round per rank and the others
    slower (the machine busier): the least round gives the costs back; the slower rounds and a
    slow rank (the median over ranks) do not raise them."""
    from omegaconf import OmegaConf

    floor = sys.modules["encoder_floor"]
    cfg = OmegaConf.create({"vision": {"image_size": 12, "patch_size": 2, "hidden_size": 384, "num_heads": 6,
                                       "ffn_hidden_size": 1536, "num_layers": 4, "select_layer": -1,
                                       "num_channels": 1}, "llm": {"hidden_size": 256}})
    flops = np.array([encoder_flops(cfg.vision, 256, i) for i in floor.ENCODER_IMAGES])
    kv_bytes = 2 * 3 * 10 * 2 * 384 * 4 * np.array(floor.KV_IMAGES)    # cp 4: one block, 3 peers, k = 10
    exact = {"encoder": (flops * PER_FLOP + 6 * PER_CALL).tolist(), "kv": (kv_bytes * PER_BYTE + 0.002).tolist(),
             "sync": 0.05}
    slower = {k: (np.asarray(v) * 1.3).tolist() for k, v in exact.items()}
    rounds = []
    for r in range(8):
        mine = [slower, exact, slower] if r != 7 else [slower] * 3   # rank 7: never exact
        rounds.append([{k: v for k, v in x.items() if k != "sync" or r < 4} for x in mine])
    units = floor.floor_units(cfg, 4, rounds)
    assert units["encoder"] == pytest.approx([PER_FLOP, PER_CALL], rel=1e-6)
    assert units["kv"] == pytest.approx([PER_BYTE, 0.002], rel=1e-6)
    assert units["sync_s"] == pytest.approx(0.05)


def test_rounds_pool_every_rounds_steps(monkeypatch):
    """`--rounds`: a layout's critical path is the median over the timed steps of every round
    (each the max over the island's ranks), its floor units come from every round's floor
    rounds, and its encoder work has one entry per pooled step, so the calibration pairs each
    pooled step's rank times with that step's work."""
    from types import SimpleNamespace as NS

    monkeypatch.setattr(bench, "layout_model", lambda cfg, layouts, args: {
        "llm": {"critical": 1.0, "bound": 0.9}, "vision": {"work": [[[1.0] * 4] * 4] * 2, "cp": 1}})
    seen = []

    def units(cfg, cp, floors):
        seen.append(floors)
        return {"encoder": [1e-9, 1e-3], "sync_s": 0.01}

    monkeypatch.setattr(bench, "floor_units", units)

    def rnd(vision, llm):   # 2 steps: the 4 vision ranks' and the 4 LLM ranks' busy seconds
        return ([{"busy": vision[r], "head": "vision", "floor": [f"v{r}"], "losses": [5.0, 5.0]} for r in range(4)]
                + [{"busy": llm, "head": "llm", "floor": ["l"], "losses": [5.0, 5.0]}] * 4)

    rounds = [rnd([[1.0, 2.0]] * 4, [0.5, 0.6]), rnd([[3.0, 4.0], [1.0, 1.0], [1.0, 1.0], [5.0, 1.0]], [0.7, 0.8])]
    out = bench.run_layout("dynamic", NS(vision=NS(hidden_size=384)), {"vision": NS(cp=1)}, rounds, None)
    assert out["critical_s"] == {"vision": np.median([1.0, 2.0, 5.0, 4.0]), "llm": np.median([0.5, 0.6, 0.7, 0.8])}
    assert seen[0][:4] == [["v0", "v0"], ["v1", "v1"], ["v2", "v2"], ["v3", "v3"]]
    assert len(out["model"]["vision"]["work"]) == 4 and len(out["vision_busy_s"][0]) == 4
    assert out["losses"] == [5.0, 5.0]
