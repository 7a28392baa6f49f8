"""Regenerate the README's command-derived figures, or check that they are current.

    python scripts/readme_figures.py           # rewrite the blocks in README.md
    python scripts/readme_figures.py --check   # exit 1 and show the difference if they drifted

Each block sits between `<!-- figures: NAME -->` and `<!-- /figures -->` in README.md and holds
the command (a bash fence) and what it prints (a plain fence). The commands live here (`BLOCKS`),
so the README shows exactly what was run; each runs in plan mode (one process, no training), in
a temporary folder. tests/test_readme_figures.py runs `--check`'s comparison.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")


def plan_sweep(args: list[str]) -> str:
    """What `python train.py -m ARGS` (a plan sweep) leaves in `plan_comparison.txt`."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "-m", *args,
                               f"hydra.sweep.dir={tmp}/sweep"], cwd=tmp, env=env, capture_output=True,
                              text=True, timeout=900)
        table = os.path.join(tmp, "sweep", "plan_comparison.txt")
        if proc.returncode or not os.path.isfile(table):
            raise RuntimeError(f"python train.py -m {shlex.join(args)} failed:\n{proc.stderr[-3000:]}")
        with open(table) as f:
            return f.read()


BLOCKS = {
    "plan_sweep": (["+recipe=llava_hetero", "mode=plan", "llm.layout.tp=4,8", "llm.layout.pp=1,2"], plan_sweep),
}
"""name -> (the arguments of `python train.py -m`, the function that runs them and returns the output)."""


def render(name: str) -> str:
    """The block `name` as it belongs between its markers: the command, then its output."""
    args, run = BLOCKS[name]
    return (f"```bash\npython train.py -m {shlex.join(args)}\n```\n\n```\n{run(args).rstrip()}\n```\n")


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- figures: {name} -->\n)(.*?)(<!-- /figures -->)", re.S)


def regenerate(text: str, names=None) -> str:
    """`text` (the README) with every block in `names` (default: all) rendered anew.

    Raises:
        ValueError: a block's markers are missing from `text`.
    """
    for name in names or BLOCKS:
        if not _pattern(name).search(text):
            raise ValueError(f"README.md has no `<!-- figures: {name} -->` ... `<!-- /figures -->` block")
        block = render(name)
        text = _pattern(name).sub(lambda m: m.group(1) + block + m.group(3), text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when README.md drifted")
    args = parser.parse_args(argv)
    with open(README) as f:
        old = f.read()
    new = regenerate(old)
    if args.check:
        diff = list(difflib.unified_diff(old.splitlines(), new.splitlines(), "README.md", "regenerated", lineterm=""))
        print("\n".join(diff) or "README.md figures are current")
        return 1 if diff else 0
    with open(README, "w") as f:
        f.write(new)
    print("README.md figures regenerated" if new != old else "README.md figures are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
