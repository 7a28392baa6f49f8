"""Regenerate the command-derived figures of README.md and docs/*.md, or check them.

    python scripts/readme_figures.py           # rewrite the blocks in the pages that hold them
    python scripts/readme_figures.py --check   # exit 1 and show the difference if they drifted

Each block sits between `<!-- figures: NAME -->` and `<!-- /figures -->` in exactly one page
(README.md or a page of docs/) and holds the command (a bash fence) and what it prints (a plain
fence). The commands live here (`BLOCKS`), so the page shows exactly what was run; each runs
in plan mode (one process, no training), in a temporary folder. tests/test_readme_figures.py
runs `--check`'s comparison.
"""
from __future__ import annotations

import argparse
import difflib
import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")


def pages() -> list[str]:
    """README.md and every page of docs/: where figure blocks may sit."""
    return [README, *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]


def plan_sweep(args: list[str]) -> str:
    """What `python train.py -m ARGS` (a plan sweep) leaves in `plan_comparison.txt`."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "-m", *args,
                               f"hydra.sweep.dir={tmp}/sweep"], cwd=tmp, env=env,
                              capture_output=True, text=True, timeout=900)
        table = os.path.join(tmp, "sweep", "plan_comparison.txt")
        if proc.returncode or not os.path.isfile(table):
            raise RuntimeError(f"python train.py -m {shlex.join(args)} "
                               f"failed:\n{proc.stderr[-3000:]}")
        with open(table) as f:
            return f.read()


BLOCKS = {
    "plan_sweep": (["+recipe=llava_hetero", "mode=plan", "llm.layout.tp=4,8", "llm.layout.pp=1,2"],
                   plan_sweep),
}
"""name -> (the arguments of `python train.py -m`, the function that runs them and returns the
output)."""


def render(name: str) -> str:
    """The block `name` as it belongs between its markers: the command, then its output."""
    args, run = BLOCKS[name]
    return (f"```bash\npython train.py -m "
            f"{shlex.join(args)}\n```\n\n```\n{run(args).rstrip()}\n```\n")


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- figures: {name} -->\n)(.*?)(<!-- /figures -->)", re.S)


def locate() -> dict[str, str]:
    """Block name -> the page that holds it.

    Raises:
        ValueError: a block of `BLOCKS` sits in no page, or in more than one.
    """
    where: dict[str, list[str]] = {name: [] for name in BLOCKS}
    for path in pages():
        with open(path) as f:
            text = f.read()
        for name in BLOCKS:
            if _pattern(name).search(text):
                where[name].append(path)
    for name, paths in where.items():
        if len(paths) != 1:
            raise ValueError(f"figure block {name} must sit in exactly one page of README.md and "
                             f"docs/, found in {len(paths)}: {paths}")
    return {name: paths[0] for name, paths in where.items()}


def regenerate(text: str, names=None) -> str:
    """`text` (a page) with every block in `names` (default: all) rendered anew.

    Raises:
        ValueError: a block's markers are missing from `text`.
    """
    for name in names or BLOCKS:
        if not _pattern(name).search(text):
            raise ValueError(f"the page has no `<!-- figures: {name} -->` ... `<!-- /figures -->` "
                             "block")
        block = render(name)
        text = _pattern(name).sub(lambda m: m.group(1) + block + m.group(3), text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare only; exit 1 when a page drifted")
    args = parser.parse_args(argv)
    by_page: dict[str, list[str]] = {}
    for name, path in locate().items():
        by_page.setdefault(path, []).append(name)
    drifted = 0
    for path, names in by_page.items():
        rel = os.path.relpath(path, REPO)
        with open(path) as f:
            old = f.read()
        new = regenerate(old, names)
        if args.check:
            diff = list(difflib.unified_diff(old.splitlines(), new.splitlines(), rel, "regenerated",
                                             lineterm=""))
            print("\n".join(diff) or f"{rel} figures are current")
            drifted += bool(diff)
            continue
        with open(path, "w") as f:
            f.write(new)
        print(f"{rel} figures regenerated" if new != old else f"{rel} figures are current")
    return 1 if drifted else 0


if __name__ == "__main__":
    sys.exit(main())
