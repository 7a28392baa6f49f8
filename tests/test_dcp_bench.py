"""Smoke run of benchmarks/dynamic_cp.py at tiny sizes (all options, JSON keys)."""
import importlib.util
import json
from pathlib import Path

from bench_utils import run_benchmark

ROOT = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location("dynamic_cp", ROOT / "benchmarks/dynamic_cp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_tiny_run_writes_json_and_timeline(tmp_path):
    out, png = tmp_path / "out.json", tmp_path / "tl.png"
    run_benchmark("dynamic_cp", ["--global-batch", "12", "--cp-pool", "4", "--pp", "1",
                                 "--max-tokens-per-rank", "1024", "--max-len", "4096", "--seeds",
                                 "100,101", "--exact", "--exact-time-limit", "5", "--json",
                                 str(out), "--timeline", str(png)])
    data = json.loads(out.read_text())
    for k in ("packing_only", "greedy", "solver", "exact"):
        assert {"mean_time_over_bound", "mean_solve_ms", "tflops_per_gpu",
                "mean_time_over_optimum"} <= set(data[k])
        assert data[k]["mean_time_over_bound"] >= 1.0
    assert data["solver_over_exact"]["mean"] >= 1 - 1e-9  # the exact plan is never slower
    assert png.stat().st_size > 0


def test_benchmark_pipeline_run():
    args = ["--global-batch", "64", "--cp-pool", "4", "--pp", "4", "--max-tokens-per-rank",
            "2048", "--max-len", "8192", "--seeds", "100"]
    s = run_benchmark("dynamic_cp", args)
    assert s["solver"]["mean_time_over_bound"] <= s["greedy"]["mean_time_over_bound"]
    tight = run_benchmark("dynamic_cp", args + ["--lp-bound"])  # the pinned pipeline bound: tighter
    assert 1.0 <= tight["solver"]["mean_time_over_bound"] < s["solver"]["mean_time_over_bound"]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / f"benchmarks/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_critical_path_lets_groups_run_ahead_and_waits_for_the_slowest_member():
    cp = _load("dynamic_cp_train").critical_path
    # 4 ranks; micro-batch 0: two CP-2 groups, micro-batch 1: one group of all 4 ranks
    groups = [[(2, 0), (4, 0)]] * 2 + [[(2, 1), (4, 0)]] * 2
    busy = [[1.0, 0.5], [3.0, 0.5], [2.0, 0.25], [2.0, 1.0]]
    assert cp(busy, groups) == 3.0 + 1.0  # the whole-pool one starts after rank 1's 3 s
    # two CP-1 lanes never wait for each other
    assert cp([[1.0, 1.0], [5.0, 0.0]], [[(1, 0), (1, 0)], [(1, 1), (1, 1)]]) == 5.0


def test_broadcast_benchmark_times_both_ways_on_forked_ranks(tmp_path):
    out = tmp_path / "b.json"
    run_benchmark("dynamic_cp_broadcast", ["--ranks", "2", "--reps", "1", "--settings",
                                           "pool64_pp1_lognormal", "--json", str(out)])
    v = json.loads(out.read_text())["pool64_pp1_lognormal"]
    assert v["plan_s"] > 0 and v["broadcast_s"] > 0 and v["bytes"] > 1000 and v["step_s"] > 0


def test_lp_bound_without_highspy_is_a_parser_error(monkeypatch, capsys):
    import sys

    import pytest

    monkeypatch.setitem(sys.modules, "highspy", None)  # `import highspy` raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        load_bench().parse_args(["--lp-bound"])
    assert exit_info.value.code == 2
    assert "--lp-bound needs highspy" in capsys.readouterr().err
