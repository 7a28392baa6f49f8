"""The command-derived figures of README.md and docs/*.md are what their commands print today
(`scripts/readme_figures.py`; plan mode only, no training)."""
import importlib.util
import os

import pytest

from cfg_utils import REPO


def _script():
    spec = importlib.util.spec_from_file_location("readme_figures", os.path.join(REPO, "scripts", "readme_figures.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(900)
def test_the_readme_figures_are_what_their_commands_print():
    figures = _script()
    for name, path in figures.locate().items():
        with open(path) as f:
            text = f.read()
        assert figures.regenerate(text, [name]) == text, (
            f"{name} in {path} drifted: run python scripts/readme_figures.py")


def test_a_block_without_its_markers_is_an_error():
    with pytest.raises(ValueError, match="no `<!-- figures: plan_sweep -->`"):
        _script().regenerate("no markers here")


def test_every_block_sits_in_exactly_one_page_and_the_plan_sweep_in_planning_md():
    figures = _script()
    assert figures.locate()["plan_sweep"] == os.path.join(REPO, "docs", "planning.md")
    figures.BLOCKS["twice"] = figures.BLOCKS["plan_sweep"]
    try:
        with pytest.raises(ValueError, match="figure block twice must sit in exactly one page"):
            figures.locate()
    finally:
        del figures.BLOCKS["twice"]
