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
