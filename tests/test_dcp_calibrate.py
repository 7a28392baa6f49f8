"""mode=calibrate: the fit recovers a known cost model and its profile reproduces it."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from hcp.config.compose import compose_config
from hcp.train.calibrate import fit, grid
from hcp.dcp.cost_model import CostModel, HardwareProfile, load_profile

ROOT = Path(__file__).resolve().parents[1]
LLM = compose_config(["+recipe=llama_tiny"]).llm


def synthetic(a, b, g, o, k1=3.0):
    return [[L, d, c, k1 * (a * d * L / c + b * d * L * L / c + g * d * L * (c - 1) / c) + o]
            for L, d in grid() for c in (1, 2, 4)]


def test_fit_recovers_coefficients_and_the_profile_reproduces_the_times(tmp_path):
    rows = synthetic(2e-6, 3e-9, 5e-7, 4e-3)
    prof = fit(rows, LLM, recompute=False, bytes_per_element=4, max_cp=4)
    got = prof.pop("fit")
    assert max(abs(p["rel_error"]) for p in got["points"]) < 1e-9
    np.testing.assert_allclose([got["coefficients"][k] for k in "abgo"],
                               [2e-6, 3e-9, 5e-7, 4e-3], rtol=1e-6)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({**prof, "fit": got}))
    cost = CostModel(LLM, load_profile(path), pp=1, tp=1, recompute=False)
    o = cost.hw.micro_batch_overhead_fwd + cost.hw.micro_batch_overhead_bwd
    for L, d, c, y in rows:
        t = 3.0 * cost.fwd(d * L, d * L * L, c)[0] + o
        assert t == pytest.approx(y, rel=1e-6)


def test_a_coefficient_fitted_to_zero_is_a_negligible_cost():
    prof = fit(synthetic(2e-6, 3e-9, 0.0, 4e-3), LLM, False, 4, 4)
    prof.pop("fit")
    hw = HardwareProfile(**prof)  # valid: every field in range
    assert hw.nvlink_bandwidth >= 1e17


@pytest.mark.slow
def test_calibrate_mode_writes_a_loadable_profile(tmp_path):
    """python train.py +recipe=llama_tiny mode=calibrate on one rank (cp 1; larger CP sizes
    run the same code on more forked ranks: benchmarks/dynamic_cp_train.py uses up to 8)."""
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "+recipe=llama_tiny",
                          "mode=calibrate", "launcher.nproc_per_node=1",
                          f"hydra.run.dir={tmp_path}"], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fit: mean |error|" in out.stdout
    hw = load_profile(tmp_path / "profile.yaml")
    assert 0 < hw.matmul_efficiency <= 1 and hw.micro_batch_overhead_fwd >= 0
