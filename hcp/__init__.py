"""hcp: declarative, Hydra-driven training with heterogeneous and dynamic context parallelism.

torch is not a hard dependency of the package (pyproject.toml): pip would resolve it to PyPI's
default build, a multi-GB CUDA wheel, and could replace the build a GPU container ships.
`scripts/setup.sh` installs the CPU build where none is importable; `torch_problem` is the
check the command line runs first.
"""
from __future__ import annotations

TORCH_MIN = (2, 8)
"""The oldest torch hcp runs on: FSDP2's set_force_sum_reduction_for_comms
(tests/test_torch_bound.py); the same bound as pyproject.toml's `torch` extra."""


def torch_problem() -> str | None:
    """Why this environment cannot run hcp's torch code, with the fix; None when it can."""
    import importlib.metadata
    import importlib.util

    fix = ("Fix: `bash scripts/setup.sh` (installs the CPU build when none is importable), or "
           "`pip install torch --index-url https://download.pytorch.org/whl/cpu`, or the build "
           "for your CUDA (https://pytorch.org/get-started/locally/)")
    if importlib.util.find_spec("torch") is None:
        return ("torch is not installed (hcp does not pull it in: pip would pick a multi-GB CUDA "
                f"build). {fix}")
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # a source build without metadata
        return None
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if len(parts) == 2 and parts < TORCH_MIN:
        need = ".".join(map(str, TORCH_MIN))
        fix = fix.replace("install torch ", "install 'torch>=" + need + "' ", 1)
        return f"torch {version} is older than {need}, the oldest hcp runs on. {fix}"
    return None
