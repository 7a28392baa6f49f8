"""The recipes `+recipe=NAME` selects: `recipes/NAME.yaml` at the top of a source tree, or
`hcp/recipes` of an installed package (pyproject.toml ships `recipes/` there as package data).

Hydra reads a config group from a sub-folder of a search-path root, and the recipes live beside
`conf/`, not in it; so each file is registered with Hydra's ConfigStore as an option of the group
`recipe` (defaults list and `# @package` header kept), and `+recipe=NAME` composes as if the
file sat in `conf/recipe/`.
"""
from __future__ import annotations

import os
import re

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES_DIR = next((d for d in (os.path.join(_PACKAGE, "recipes"),  # an installed wheel
                                os.path.join(os.path.dirname(_PACKAGE), "recipes"))  # a source tree
                    if os.path.isdir(d)), os.path.join(os.path.dirname(_PACKAGE), "recipes"))
"""The recipe folder: `recipes/` of the source tree, or `hcp/recipes` of an installed package."""

GROUP = "recipe"
"""The config group the recipes form (`+recipe=NAME`)."""


def recipe_names(recipes_dir: str = RECIPES_DIR) -> list[str]:
    """The recipes there are, sorted: the stems of `recipes_dir/*.yaml`."""
    return sorted(f[:-5] for f in os.listdir(recipes_dir) if f.endswith(".yaml"))


def register_recipes(recipes_dir: str = RECIPES_DIR) -> None:
    """Register every `recipes_dir/NAME.yaml` with Hydra's ConfigStore as `recipe/NAME`, in the
    package its `# @package PKG` header names (Hydra's default for a group file: `recipe`)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    for name in recipe_names(recipes_dir):
        path = os.path.join(recipes_dir, f"{name}.yaml")
        with open(path) as f:
            header = re.match(r"#\s*@package\s+(\S+)", f.readline())
        store.store(group=GROUP, name=name, node=OmegaConf.load(path),
                    package=header.group(1) if header else GROUP, provider="hcp recipes")
