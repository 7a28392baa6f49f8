"""A small mutation check: plant one single-line bug at a time in a module and see whether the
tests that cover it fail.

    python scripts/mutate.py hcp/schedule/actions.py tests/test_plan_actions.py --max 20
    python scripts/mutate.py hcp/dcp/lower_bound.py tests/test_dcp_bound_whole_pool.py --json o.json

Mutations (one per mutant, at one place of the module's code, docstrings untouched): an
arithmetic operator swapped (+ -, * /), a comparison moved across its boundary (< <=, > >=,
== !=, in / not in), `and` / `or` swapped, a `not` dropped, an integer constant changed by one,
`min` / `max` swapped, a method call dropped (`x.clamp(max=1.0)` -> `x`), a statement that is
a call dropped (`restore(state)` -> `pass`). Each mutant is written into a copy of the
repository (the working tree is never touched) and the given tests run there in a fresh
`python -m pytest -x -q` (PYTHONPATH the copy); a mutant is killed when they fail or time out,
and survives when they pass. Sites are spread evenly over the module when there are more
than `--max`. The same idea as mutmut or cosmic-ray, small enough to run in the suite.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWAP_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
            ast.FloorDiv: ast.Mult}
SWAP_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
            ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In}
DROPPED_METHODS = {"clamp", "clamp_", "clip", "abs", "sqrt", "copy", "clone", "contiguous",
                   "detach", "item", "sum", "max", "min", "float", "double", "tolist"}


@dataclass
class Mutant:
    """One planted bug: where (1-based line of the module) and what."""

    line: int
    what: str
    outcome: str = ""  # killed | survived | timeout


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring expressions (never mutated)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0]))
    return out


def sites(source: str) -> list[tuple[int, str]]:
    """(index of the node in `ast.walk` order, description) of every mutation of `source`."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    out = []
    for k, node in enumerate(ast.walk(tree)):
        what = _describe(node, skip)
        if what:
            out.append((k, f"line {getattr(node, 'lineno', 0)}: {what}"))
    return out


def _describe(node: ast.AST, skip: set[int]) -> str | None:
    """What mutating `node` does, or None when it is no mutation site."""
    name = lambda op: type(op).__name__  # noqa: E731
    if isinstance(node, ast.BinOp) and type(node.op) in SWAP_BIN:
        return f"{name(node.op)} -> {SWAP_BIN[type(node.op)].__name__}"
    if isinstance(node, ast.Compare) and type(node.ops[0]) in SWAP_CMP:
        return f"{name(node.ops[0])} -> {SWAP_CMP[type(node.ops[0])].__name__}"
    if isinstance(node, ast.BoolOp):
        return f"{name(node.op)} -> {'Or' if isinstance(node.op, ast.And) else 'And'}"
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return "drop not"
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return f"{node.value} -> {node.value + 1}"
    func = node.func if isinstance(node, ast.Call) else None
    if isinstance(func, ast.Name) and func.id in ("min", "max"):
        return f"{func.id} -> {'max' if func.id == 'min' else 'min'}"
    if isinstance(func, ast.Attribute) and func.attr in DROPPED_METHODS:
        return f"drop .{func.attr}(...)"
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and id(node) not in skip:
        return "drop the call statement"
    return None


class _Mutate(ast.NodeTransformer):
    """Apply the mutation at node index `target` (ast.walk order of the unmodified tree)."""

    def __init__(self, tree: ast.AST, target: int):
        self.node = list(ast.walk(tree))[target]

    def visit(self, node):
        if node is not self.node:
            return self.generic_visit(node)
        if isinstance(node, ast.BinOp):
            node.op = SWAP_BIN[type(node.op)]()
        elif isinstance(node, ast.Compare):
            node.ops[0] = SWAP_CMP[type(node.ops[0])]()
        elif isinstance(node, ast.BoolOp):
            node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        elif isinstance(node, ast.UnaryOp):
            return node.operand
        elif isinstance(node, ast.Constant):
            node.value += 1
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            node.func.id = "max" if node.func.id == "min" else "min"
        elif isinstance(node, ast.Call):
            return node.func.value
        elif isinstance(node, ast.Expr):
            return ast.Pass()
        return node


def mutant_source(source: str, target: int) -> str:
    """`source` with the mutation at node index `target` (of `sites`) applied."""
    tree = ast.parse(source)
    tree = _Mutate(tree, target).visit(tree)
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def run(module: str, tests: list[str], max_mutants: int = 20, timeout: float = 300,
        repo: str = REPO, log=print) -> list[Mutant]:
    """Plant up to `max_mutants` mutants of `module` (a path relative to `repo`) one at a time in
    a copy of `repo` and run `tests` (pytest arguments, relative to `repo`) against each."""
    with open(os.path.join(repo, module)) as f:
        source = f.read()
    found = sites(source)
    if len(found) > max_mutants:  # spread evenly over the module
        step = (len(found) - 1) / max(max_mutants - 1, 1)
        found = [found[round(i * step)] for i in range(max_mutants)]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "repo")
        shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(
            ".git", "outputs", "multirun", "__pycache__", ".pytest_cache", "*.egg-info"))
        target = os.path.join(copy, module)
        env = {**os.environ, "PYTHONPATH": copy, "PYTHONDONTWRITEBYTECODE": "1"}
        for k, what in found:
            mutant = Mutant(int(what.split(":")[0].split()[1]), what)
            with open(target, "w") as f:
                f.write(mutant_source(source, k))
            try:
                proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                                       "no:cacheprovider", *tests], cwd=copy, env=env,
                                      capture_output=True, timeout=timeout)
                mutant.outcome = "survived" if proc.returncode == 0 else "killed"
            except subprocess.TimeoutExpired:
                mutant.outcome = "timeout"
            log(f"{module} {what}: {mutant.outcome}")
            out.append(mutant)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("module", help="the module to mutate, e.g. hcp/schedule/actions.py")
    parser.add_argument("tests", nargs="+", help="pytest arguments that cover it")
    parser.add_argument("--max", type=int, default=20, help="mutants at most (spread evenly)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per mutant's tests")
    parser.add_argument("--json", default=None, help="write every mutant and its outcome here")
    args = parser.parse_args(argv)
    mutants = run(args.module, args.tests, args.max, args.timeout)
    killed = sum(m.outcome != "survived" for m in mutants)
    print(f"{args.module}: {killed} of {len(mutants)} mutants killed, "
          f"{len(mutants) - killed} survived")
    for m in mutants:
        if m.outcome == "survived":
            print(f"  survived: {m.what}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"module": args.module, "tests": args.tests,
                       "mutants": [asdict(m) for m in mutants]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
