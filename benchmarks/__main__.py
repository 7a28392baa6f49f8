"""The one entry of hcp's benchmarks.

    python -m benchmarks                      # the benchmarks, with a line on what each measures
    python -m benchmarks NAME [flags]         # run one (`--help`: its flags and table columns)

A benchmark is a file of this folder with a `main(argv)` and a `__main__` block (so
`python benchmarks/NAME.py [flags]` runs the same code); the other files are the libraries they
share (harness.py: parser, common flags, `--json`, tables, forked ranks)."""
from __future__ import annotations

import ast
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def benchmarks() -> dict[str, str]:
    """{name: the first sentence of its docstring} of every runnable benchmark here, by name;
    read without importing them (several import torch and the trainer)."""
    found = {}
    for file in sorted(os.listdir(HERE)):
        if not file.endswith(".py") or file.startswith("_"):
            continue
        with open(os.path.join(HERE, file)) as f:
            tree = ast.parse(f.read())
        runnable = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)
                       for n in tree.body)
        if runnable:
            first = " ".join((ast.get_docstring(tree) or "").split("\n\n")[0].split())
            found[file[:-3]] = first.split(". ")[0].rstrip(".")
    return found


def main(argv: list[str] | None = None):
    """List the benchmarks (no argument), or run `NAME` with the remaining flags and return what
    its `main` returns (`NAME.py` or a path to it is taken too). SystemExit (status 1) naming
    the choices for an unknown NAME."""
    argv = sys.argv[1:] if argv is None else argv
    names = benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, names))
        print("usage: python -m benchmarks NAME [flags]   (NAME --help: its flags)\n")
        for name, line in names.items():
            print(f"  {name:<{width}}  {line}")
        print("\nflags every benchmark takes: --json PATH (write its results there), --help")
        return None
    name, rest = argv[0], argv[1:]
    if name.endswith(".py"):
        name = os.path.basename(name)[:-3]
    if name not in names:
        sys.exit(f"python -m benchmarks: no benchmark {name!r}; choose one of {', '.join(names)}")
    if HERE not in sys.path:  # the benchmarks import their libraries beside them by bare name
        sys.path.insert(0, HERE)
    module = importlib.import_module(name)
    prog, sys.argv[0] = sys.argv[0], f"python -m benchmarks {name}"  # argparse's usage and errors
    try:
        return module.main(rest)
    finally:
        sys.argv[0] = prog


if __name__ == "__main__":
    main()
