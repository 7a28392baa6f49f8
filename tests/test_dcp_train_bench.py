"""benchmarks/dynamic_cp_train.py on 2 forked ranks: the busy time it reports counts the CP
collectives (gloo runs them outside the calling thread), its JSON has the issue's keys per
(lengths, seed) run and their medians per distribution, and static and dynamic CP give the same
loss (it runs the trainer's step)."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_measured_run_counts_communication_in_busy_time(tmp_path):
    from bench_utils import run_benchmark

    out = tmp_path / "r.json"
    run_benchmark("dynamic_cp_train", ["--ranks", "2", "--steps", "1", "--reps", "1",
                                       "--global-batch", "4", "--lengths", "wikipedia,code",
                                       "--seeds", "100,101", "--micro-batch-tokens", "256",
                                       "--profile", "h100", "--json", str(out)])
    data = json.loads(out.read_text())
    assert [(r["lengths"], r["seed"]) for r in data["runs"]] == [
        ("wikipedia", 100), ("wikipedia", 101), ("code", 100), ("code", 101)]
    keys = {"measured_speedup", "predicted_speedup", "bound_speedup", "measured_over_bound",
            "prediction_error"}
    for r in data["runs"]:
        assert {"static", "dynamic"} | keys <= set(r)
    assert set(data["summary"]) == {"wikipedia", "code"}
    for r in data["runs"]:  # the trainer's token-level loss: the same whatever the plan
        assert r["loss_rel_diff"] < 1e-5, r["loss_rel_diff"]
    run = data["runs"][0]
    static = run["static"]
    assert static["cp_histogram"] == {"2": 4}  # every document on the whole pool of 2
    # the all-gathers and reduce-scatters of every CP-2 micro-batch: busy time > thread time
    assert static["comm_share"] > 0.03, static["comm_share"]
    for crit, compute in zip(static["critical_path_s_reps"],
                             static["critical_path_compute_s_reps"]):
        assert crit > compute > 0
    # the cost model's errors per micro-batch: on whole-pool micro-batches the critical path is
    # the sum of each one's slowest rank (one rep: its own figures)
    mbs = static["micro_batch_errors"]
    assert all(m["cp"] == 2 for m in mbs) and sum(m["docs"] for m in mbs) == 4
    assert sum(m["measured_s"] for m in mbs) == pytest.approx(static["critical_path_s"], rel=1e-9)
    assert all(m["predicted_s"] > 0 for m in mbs)


def test_prediction_runs_rows_without_a_synchronisation_per_row():
    """`predicted_path`: a round where the group on ranks 0-3 runs two micro-batches and the
    one on ranks 4-7 one lasts the busier group's sum (the trainer skips the empty row entry and
    nothing spans the two groups), not the sum of each row's slowest (`simulate_plan`, which
    fails this); a plan of whole-pool micro-batches lasts their sum either way."""
    import numpy as np

    from hcp.dcp.cost_model import CostModel, recipe_llm
    from hcp.dcp.hardware import load_profile
    from hcp.dcp.packing import Group, Packing, Round
    from hcp.dcp.policy import rows
    from hcp.dcp.solver import simulate_plan

    spec = importlib.util.spec_from_file_location("dcp_train",
                                                  ROOT / "benchmarks/dynamic_cp_train.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cost = CostModel(recipe_llm("llama_tiny"),
                     load_profile(ROOT / "hcp/dcp/profiles/gloo_llama_tiny.yaml"), pp=1, tp=1,
                     recompute="none")
    lens = np.array([900, 300, 1000])
    plan = Packing([Round([Group([0, 1], 4, 0, [1, 1]), Group([2], 4, 4)])])
    one = [simulate_plan(Packing([Round([Group([i], 4, 0)])]), lens, cost).iteration_time
           for i in range(3)]
    assert bench.predicted_path(rows(plan), lens, cost) == pytest.approx(
        max(one[0] + one[1], one[2]), rel=1e-12)
    assert simulate_plan(rows(plan), lens, cost).iteration_time == pytest.approx(
        max(one[0], one[2]) + one[1], rel=1e-12)
    whole = Packing([Round([Group([i], 8, 0)]) for i in range(3)])
    assert bench.predicted_path(whole, lens, cost) == pytest.approx(
        simulate_plan(whole, lens, cost).iteration_time, rel=1e-12)
