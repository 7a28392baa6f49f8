"""Packages of the wheel: every `hcp*` package found here, plus `conf/` and `recipes/` shipped as
the package data `hcp/conf` and `hcp/recipes` (they stay at the top of the source tree, where
users edit them; `hcp.config.compose.CONF_DIR` and `hcp.config.recipes.RECIPES_DIR` find
either). Everything else is in pyproject.toml."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["hcp", "hcp.*"]) + ["hcp.conf", "hcp.recipes"],
      package_dir={"hcp.conf": "conf", "hcp.recipes": "recipes"})
