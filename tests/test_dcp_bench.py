"""Smoke run of benchmarks/dynamic_cp.py at tiny sizes (all options, JSON keys)."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location("dynamic_cp", ROOT / "benchmarks/dynamic_cp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_tiny_run_writes_json_and_timeline(tmp_path):
    bench = load_bench()
    out, png = tmp_path / "out.json", tmp_path / "tl.png"
    bench.main(["--global-batch", "12", "--cp-pool", "4", "--pp", "1", "--max-tokens-per-rank",
                "1024", "--max-len", "4096", "--seeds", "100,101", "--exact", "--exact-time-limit",
                "5", "--json", str(out), "--timeline", str(png)])
    data = json.loads(out.read_text())
    for k in ("packing_only", "greedy", "solver", "exact"):
        assert {"mean_time_over_bound", "mean_solve_ms", "tflops_per_gpu",
                "mean_time_over_optimum"} <= set(data[k])
        assert data[k]["mean_time_over_bound"] >= 1.0
    assert data["solver_over_exact"]["mean"] >= 1 - 1e-9  # the exact plan is never slower
    assert png.stat().st_size > 0


def test_benchmark_pipeline_run():
    s = load_bench().main(["--global-batch", "64", "--cp-pool", "4", "--pp", "4",
                           "--max-tokens-per-rank", "2048", "--max-len", "8192", "--seeds", "100"])
    assert s["solver"]["mean_time_over_bound"] <= s["greedy"]["mean_time_over_bound"]
