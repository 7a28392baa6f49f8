"""The repository stands alone: its design is docs/design.md, and nothing tracked points readers
to a design file outside it."""
import os
import subprocess

from cfg_utils import REPO


def test_no_tracked_file_refers_to_a_design_md_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split("\0")
    stale = "DESIGN" + ".md"  # spelled apart so that this file does not match itself
    found = []
    for name in filter(None, tracked):
        path = os.path.join(REPO, name)
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                found += [f"{name}:{i}" for i, line in enumerate(f, 1) if stale in line]
    assert not found, f"{len(found)} lines point to {stale}; use docs/design.md: {found[:10]}"
    with open(os.path.join(REPO, "docs", "design.md")) as f:
        sections = [line.split(".")[0] for line in f if line.startswith("## ")]
    assert sections == [f"## {n}" for n in range(1, 9)]  # "section N" references keep their meaning
