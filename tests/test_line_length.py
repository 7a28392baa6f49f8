"""Source lines are at most 100 characters (issue 43: "lines at most 100 characters, checked").

Checks every .py file under hcp/, scripts/ and train.py.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 100


def _sources() -> list[Path]:
    return [*sorted((ROOT / "hcp").rglob("*.py")), *sorted((ROOT / "scripts").rglob("*.py")),
            ROOT / "train.py"]


def test_sources_found():
    files = _sources()
    assert ROOT / "train.py" in files and ROOT / "hcp" / "entry.py" in files
    assert ROOT / "hcp" / "dcp" / "solver.py" in files


def test_lines_at_most_100_characters():
    long = [f"{f.relative_to(ROOT)}:{n} ({len(line)} chars)"
            for f in _sources()
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > LIMIT]
    assert not long, f"{len(long)} lines over {LIMIT} characters:\n" + "\n".join(long)
