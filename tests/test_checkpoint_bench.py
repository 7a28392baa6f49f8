"""benchmarks/checkpoint_async.py runs in its tiny form through the entry (both modes side by
side, one save each); its flags and columns are checked with every benchmark's
(test_bench_cli.COLUMNS)."""
import pytest

from bench_utils import run_benchmark


@pytest.mark.timeout(300)
def test_checkpoint_async_benchmark_reports_both_modes(capsys):
    out = run_benchmark("checkpoint_async",
                        ["--tiny", "--steps", "1", "--save-every", "1", "--warmup", "0"])
    assert list(out) == ["sync", "async"]
    assert all(r["saves"] == 1 and r["step_s"] > 0 for r in out.values())
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3].split() == ["mode", "step", "s", "lost/save", "s", "blocked/save", "s", "saves"]
    assert [line.split()[0] for line in lines[-2:]] == ["sync", "async"]
