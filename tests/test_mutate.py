"""scripts/mutate.py in a tiny form: on a two-function module whose test covers only one
function, the mutant of the covered function is killed and the other survives, and the
working tree is never touched."""
import importlib.util
import os
import sys

from cfg_utils import REPO


def _script():
    path = os.path.join(REPO, "scripts", "mutate.py")
    spec = importlib.util.spec_from_file_location("mutate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutate"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_a_covered_mutant_is_killed_and_an_uncovered_one_survives(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the tiny tests need no plugin
    source = ('"""A module."""\n\n\ndef add(a, b):\n    """a + b"""\n    return a + b\n\n\n'
              'def smaller(x, y):\n    return min(x, y)\n')
    (tmp_path / "tiny.py").write_text(source)
    (tmp_path / "test_tiny.py").write_text(
        "from tiny import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n")
    mutate = _script()
    whats = [what for _, what in mutate.sites(source)]
    assert whats == ["line 6: Add -> Sub", "line 10: min -> max"]
    mutants = mutate.run("tiny.py", ["test_tiny.py"], repo=str(tmp_path), log=lambda line: None)
    assert [(m.line, m.outcome) for m in mutants] == [(6, "killed"), (10, "survived")]
    assert (tmp_path / "tiny.py").read_text() == source  # mutants live in a copy only
