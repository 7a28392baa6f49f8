"""The declared torch lower bound is the release of the newest torch API the code calls."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
API_SINCE = {  # torch API as it appears in hcp -> first torch release that has it
    "set_force_sum_reduction_for_comms": (2, 8),
    "set_gradient_divide_factor": (2, 8),
    "from torch.distributed.fsdp import FSDPModule, fully_shard": (2, 6),
    "enable_gqa=": (2, 5),
    "from torch.distributed.tensor import": (2, 5),
}


def test_torch_lower_bound_matches_the_newest_api_called():
    code = "\n".join(p.read_text() for p in (ROOT / "hcp").rglob("*.py"))
    used = {api: v for api, v in API_SINCE.items() if api in code}
    declared = re.search(r'"torch>=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert used and tuple(map(int, declared.groups())) == max(used.values()), used


def test_torch_is_no_hard_dependency_and_a_missing_or_old_one_is_one_line(monkeypatch):
    """pip would pull PyPI's multi-GB CUDA torch for a hard dependency: torch is only the
    `.[torch]` extra, with the same bound as `hcp.TORCH_MIN`, which the command line checks."""
    import importlib.metadata
    import importlib.util
    import hcp

    text = (ROOT / "pyproject.toml").read_text()
    hard = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    assert '"torch' not in hard
    bound = re.search(r'^torch = \["torch>=(\d+)\.(\d+)"\]', text, re.M).groups()
    assert bound == tuple(map(str, hcp.TORCH_MIN))
    assert hcp.torch_problem() is None
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.5.1+cu121")
    assert hcp.torch_problem().startswith(
        "torch 2.5.1+cu121 is older than 2.8, the oldest hcp runs on. Fix: `bash scripts/setup.sh`")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "torch is not installed" in hcp.torch_problem()
