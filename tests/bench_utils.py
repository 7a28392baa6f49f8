"""Run a benchmark the way users do, through its one entry `python -m benchmarks NAME`
(benchmarks/__main__.py), in this process."""
import importlib
import importlib.util
import os
import sys

from cfg_utils import REPO

_spec = importlib.util.spec_from_file_location("benchmarks_entry",
                                               os.path.join(REPO, "benchmarks", "__main__.py"))
entry = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(entry)


def run_benchmark(name: str, argv: list[str]):
    """What benchmark `name`'s `main(argv)` returns, reached through the entry."""
    return entry.main([name, *argv])


def benchmark_module(name: str):
    """The module the entry runs for `name` (to monkeypatch before `run_benchmark`)."""
    if entry.HERE not in sys.path:
        sys.path.insert(0, entry.HERE)
    return importlib.import_module(name)
