"""benchmarks/checkpoint_async.py runs in its tiny form (both modes side by side, one save each),
and every flag has help and every column is explained."""
import pytest

from test_bench_cli import _load, _parser_of


@pytest.mark.timeout(300)
def test_checkpoint_async_benchmark_reports_both_modes(capsys):
    out = _load("checkpoint_async").main(["--tiny", "--steps", "1", "--save-every", "1", "--warmup", "0"])
    assert list(out) == ["sync", "async"] and all(r["saves"] == 1 and r["step_s"] > 0 for r in out.values())
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3].split() == ["mode", "step", "s", "lost/save", "s", "blocked/save", "s", "saves"]
    assert [line.split()[0] for line in lines[-2:]] == ["sync", "async"]


def test_checkpoint_async_flags_have_help_and_columns_are_explained(monkeypatch):
    parser = _parser_of(_load("checkpoint_async"), monkeypatch)
    assert [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help] == []
    for column in ("mode", "step s", "lost/save s", "blocked/save s", "saves"):
        assert f"\n  {column}" in parser.format_help(), column
