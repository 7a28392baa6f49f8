"""Benchmark command lines: one entry (`python -m benchmarks [NAME]`) lists and runs every
benchmark with the shared flags, every flag has help, the tables' columns are explained, and
benchmarks/layouts.py prints each layout's line as soon as it finishes."""
import json
import os

import pytest

from cfg_utils import REPO


LIBRARIES = {"critical_path", "dynamic_cp_report", "encoder_floor", "harness", "hetero_plan",
             "hetero_rank", "lengths", "plain_loop", "route_keys"}


def test_the_entry_lists_every_benchmark_with_what_it_measures():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    listed = dict(line.split(None, 1) for line in out.splitlines() if line.startswith("  "))
    files = {f[:-3] for f in os.listdir(os.path.join(REPO, "benchmarks"))
             if f.endswith(".py") and not f.startswith("_")}
    assert set(listed) == files - LIBRARIES and {"layouts", "dynamic_cp", "hetero"} <= set(listed)
    assert listed["dynamic_cp"].strip().startswith("Dynamic-CP benchmark: our solver against")


def test_every_benchmark_runs_through_the_entry_with_the_shared_json_flag(capsys):
    from bench_utils import entry

    for name in entry.benchmarks():
        with pytest.raises(SystemExit) as e:
            entry.main([name, "--help"])
        text = capsys.readouterr().out
        assert e.value.code == 0 and f"usage: python -m benchmarks {name}" in text, name
        assert "--json" in text, name
    with pytest.raises(SystemExit, match="no benchmark 'nope'; choose one of attention"):
        entry.main(["nope"])


def test_step_plan_writes_its_figures_as_json_through_the_entry(tmp_path):
    from bench_utils import run_benchmark

    out = run_benchmark("step_plan", ["--repeats", "1", "--json", str(tmp_path / "s.json")])
    assert out == json.loads((tmp_path / "s.json").read_text())
    assert out["micro_batches_per_rank"] >= 1 and 0 < out["rank_cpu_s"] < out["plan_cpu_s"]


def test_layouts_prints_each_line_as_its_layout_finishes(monkeypatch, capsys):
    from bench_utils import benchmark_module, run_benchmark

    layouts = benchmark_module("layouts")
    seen = []

    def fake_run(spec, nproc, steps, warmup):
        seen.append(capsys.readouterr().out)  # what was printed before this layout started
        return {"layout": spec, "loss": 1.0, "tokens_per_s": 100.0 * (len(seen)),
                "critical_cpu_s": 0.5,
                "bytes_per_step": {"all_reduce": 2e6}}

    monkeypatch.setattr(layouts, "run_layout", fake_run)
    run_benchmark("layouts", ["--layouts", "dp4,tp2"])
    row = ["1.00", "0.500", "all_reduce=2.00"]
    assert seen[1].splitlines()[-1].split() == ["dp4", "1.0000", "100", *row]
    assert capsys.readouterr().out.split() == ["tp2", "1.0000", "200", "2.00", *row[1:]]


class _Parsed(Exception):
    pass


def _parser_of(name, monkeypatch):
    """The ArgumentParser benchmark `name` builds when run through the entry (caught at its
    parse_args call)."""
    import argparse

    from bench_utils import run_benchmark

    def catch(self, *a, **k):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(_Parsed) as e:
        run_benchmark(name, [])
    return e.value.args[0]


COLUMNS = {"layouts": ("loss", "tokens/s", "ratio", "cpu s/step", "MB/step"),
           "dynamic_cp": ("time_s", "/bound", "max/bound", "/opt", "opt<=", "M, rounds", "plan_ms",
                          "TFLOPS", "cp histogram"),
           "checkpoint_async": ("mode", "step s", "lost/save s", "blocked/save s", "saves")}


def _names():
    from bench_utils import entry

    return list(entry.benchmarks())


@pytest.mark.parametrize("name", _names())
def test_every_benchmark_flag_has_help_and_the_columns_are_explained(name, monkeypatch):
    parser = _parser_of(name, monkeypatch)
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert flags and [a.option_strings[0] for a in flags if not a.help] == []
    help_text = parser.format_help()
    assert "(default:" in help_text
    for column in COLUMNS.get(name, ()):
        assert f"\n  {column}" in help_text, column


@pytest.mark.timeout(300)
def test_attention_benchmark_json_has_per_cp_size_ratio_to_the_ideal(tmp_path):
    """benchmarks/attention.py --cp 2,4 --json: a case per CP size with its time, the ideal
    (one rank's SDPA / c) and their ratio."""
    import subprocess
    import sys

    out = tmp_path / "attn.json"
    subprocess.run([sys.executable, "-m", "benchmarks", "attention", "--long", "64",
                    "--short", "3", "--docs", "0", "--cp", "2,4", "--strategies", "allgather",
                    "--reps", "1", "--json", str(out)], check=True, capture_output=True,
                   timeout=280, cwd=REPO)
    cases = json.loads(out.read_text())["cases"]
    assert [c["cp"] for c in cases] == [2, 4] and all(c["status"] == "ok" for c in cases)
    for c in cases:
        assert c["time_over_ideal"] == pytest.approx(c["fwd_bwd_s"] / c["ideal_s"], rel=0.01)
