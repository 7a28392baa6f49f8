"""mode=calibrate: the fit recovers a known cost model and its profile reproduces it; the busy
time it measures counts gloo's communication."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from dist_utils import run_ranks

from hcp.config.compose import compose_config
from hcp.train.calibrate import fit, grid
from hcp.dcp.cost_model import CostModel, HardwareProfile, load_profile

ROOT = Path(__file__).resolve().parents[1]
LLM = compose_config(["+recipe=llama_tiny"]).llm


def synthetic(a, b, g, o, k1=3.0, lat=0.0):
    return [[L, d, c, k1 * (a * d * L / c + b * d * L * L / c + g * d * L * (c - 1) / c
                            + lat * (c - 1)) + o]
            for L, d in grid() for c in (1, 2, 4, 8)]


def test_fit_recovers_coefficients_and_the_profile_reproduces_the_times(tmp_path):
    rows = synthetic(2e-6, 3e-9, 5e-7, 4e-3, lat=1.5e-3)
    prof = fit(rows, LLM, recompute=False, bytes_per_element=4, max_cp=8)
    got = prof.pop("fit")
    assert max(abs(p["rel_error"]) for p in got["points"]) < 1e-9
    np.testing.assert_allclose([got["coefficients"][k] for k in "abglo"],
                               [2e-6, 3e-9, 5e-7, 1.5e-3, 4e-3], rtol=1e-6)
    assert prof["cp_latency"] == pytest.approx(1.5e-3 / LLM.num_layers)
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
    assert hw.nvlink_bandwidth >= 1e17 and hw.cp_latency == 0.0


def _collectives(rank, world):
    """(busy, thread) seconds of 5 all-reduces of 16 MB and of one barrier that waits 1 s for
    rank 1 (0 for rank 1's own sleep)."""
    import time

    import torch
    import torch.distributed as dist

    from hcp.train.calibrate import busy_time

    x = torch.ones(1 << 22)
    dist.barrier()
    b0, t0 = busy_time(), time.thread_time()
    for _ in range(5):
        dist.all_reduce(x)
    work = (busy_time() - b0, time.thread_time() - t0)
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)
    b0 = busy_time()
    dist.barrier()
    return work, busy_time() - b0


def test_busy_time_counts_gloo_communication_but_not_waiting():
    """gloo runs a collective on its own threads: the caller's thread CPU time misses it, the
    rank's busy time (its process's CPU time) counts it; a rank blocked on a late peer sleeps,
    so a 1 s wait adds (almost) nothing."""
    for (busy, thread), waited in run_ranks(_collectives, 2):
        assert busy > 0.01 and busy > 5 * thread, (busy, thread)  # 5 x 16 MB summed, sent
        assert waited < 0.1, waited


@pytest.mark.slow
def test_calibrate_mode_writes_a_loadable_profile(tmp_path):
    """python train.py +recipe=llama_tiny mode=calibrate on one rank (cp 1; larger CP sizes
    run the same code on more forked ranks: benchmarks/dynamic_cp_train.py uses up to 8)."""
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "+recipe=llama_tiny",
                          "mode=calibrate", "launcher.nproc_per_node=1",
                          f"hydra.run.dir={tmp_path}"], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fit: mean |error|" in out.stdout and "at CP sizes [1] " in out.stdout
    hw = load_profile(tmp_path / "profile.yaml")
    assert 0 < hw.matmul_efficiency <= 1 and hw.micro_batch_overhead_fwd >= 0


def test_a_cap_below_the_grid_is_a_config_error_before_ranks_start(tmp_path):
    """A cap under the grid's shortest document leaves nothing to time: a ConfigError naming
    trainer.micro_batch_tokens and the minimum, raised before any rank starts."""
    from hcp.config.errors import ConfigError
    from hcp.train.calibrate import MIN_LENGTH, run_calibrate

    cfg = compose_config(["+recipe=llama_tiny", "trainer.micro_batch_tokens=8"])
    with pytest.raises(ConfigError, match=f"trainer.micro_batch_tokens=8: .*>={MIN_LENGTH}"):
        run_calibrate(cfg, str(tmp_path))
    assert not any(tmp_path.iterdir())


def test_profile_errors_are_one_line_with_one_fix(tmp_path):
    from omegaconf import OmegaConf

    from hcp.config.errors import ConfigError
    from hcp.dcp.policy import check_dynamic_cp

    (tmp_path / "bad.yaml").write_text("a: [1, 2\nb: {\n")
    (tmp_path / "keys.yaml").write_text("peak_flops: 1.0e12\n")
    for name, words in (("bad.yaml", "not valid YAML at line 2"), ("keys.yaml", "missing keys")):
        with pytest.raises(ConfigError) as err:
            check_dynamic_cp(OmegaConf.create({"packing_profile": str(tmp_path / name)}))
        text = str(err.value)
        assert words in text and "\n" not in text and text.count("Fix:") == 1, text
