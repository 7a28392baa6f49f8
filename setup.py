"""Packages of the wheel: every `hcp*` package found here, plus `conf/` shipped as the package
data `hcp/conf` (it stays at the top of the source tree, where users edit it;
`hcp.config.compose.CONF_DIR` finds either). Everything else is in pyproject.toml."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["hcp", "hcp.*"]) + ["hcp.conf"], package_dir={"hcp.conf": "conf"})
