"""benchmarks/hetero.py runs end to end on a tiny configuration: both layouts report the same
loss, the heterogeneous route moves exactly the minimum bytes, each rank encodes a quarter of
the images instead of all of them, and --json has the keys issue 12 names."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import hetero  # noqa: E402


@pytest.mark.slow
def test_hetero_benchmark_tiny(tmp_path):
    path = tmp_path / "out" / "hetero.json"
    hetero.main(["--steps", "1", "--warmup", "0", "--text-tokens", "8", "--json", str(path),
                 "vision.image_size=8", "vision.patch_size=2", "vision.hidden_size=64",
                 "vision.num_heads=2", "vision.ffn_hidden_size=128", "llm.num_layers=2"])
    layouts = json.loads(path.read_text())["layouts"]
    homo, het = layouts["homogeneous"], layouts["heterogeneous"]
    for r in (homo, het):
        assert {"critical_path_s", "step_wall_s", "encoder_flops_per_rank", "route_bytes",
                "route_min_bytes", "tokens_per_s"} <= set(r)
    assert abs(homo["loss"] - het["loss"]) < 1e-5
    assert het["route_bytes"] == het["route_min_bytes"] > 0 and homo["route_bytes"] == 0
    assert homo["images_per_rank"] == [12] * 4 and het["images_per_rank"] == [3] * 4
    assert max(het["encoder_flops_per_rank"]) * 4 == pytest.approx(max(homo["encoder_flops_per_rank"]))
