"""mode=calibrate: the fit recovers a known cost model and its profile reproduces it; the busy
time it measures counts gloo's communication."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from dist_utils import run_ranks

from hcp.config.compose import compose_config
import hcp.preflight.calibrate as calibrate
from hcp.preflight.calibrate import fit, grid
from hcp.dcp.cost_model import CostModel
from hcp.dcp.hardware import HardwareProfile, load_profile

ROOT = Path(__file__).resolve().parents[1]
LLM = compose_config(["+recipe=llama_tiny"]).llm


def synthetic(a, b, g, o, k1=3.0, e=None):
    """Times of the calibration model on the uncapped grid at c = 1, 2, 4, 8; `b`: one attention
    coefficient, or {c: b_c}; `e`: {c: fixed seconds per micro-batch at c > 1} or None."""
    b = b if isinstance(b, dict) else dict.fromkeys((1, 2, 4, 8), b)
    e = {1: 0.0, **(e or dict.fromkeys((2, 4, 8), 0.0))}
    return [[L, d, c, k1 * (a * d * L / c + b[c] * d * L * L / c + g * d * L * (c - 1) / c
                            + e[c]) + o]
            for L, d in grid() for c in (1, 2, 4, 8)]


B_CP = {1: 3e-9, 2: 4.5e-9, 4: 5e-9, 8: 7e-9}  # CP attention slower than c = 1's fused SDPA
E_CP = {2: 2e-3, 4: 1e-3, 8: 3e-3}  # fixed per micro-batch, not linear in c - 1 (no ring latency)


@pytest.mark.parametrize("outlier", [False, True])
def test_fit_recovers_per_cp_size_coefficients_and_the_profile_reproduces_the_times(tmp_path, outlier,
                                                                                   monkeypatch):
    """Synthetic times with one attention coefficient and one fixed cost per CP size; with
    `outlier`, one point measured 3x too slow (a rank that shared its core) is given a small
    weight and the others are still reproduced (a plain least-squares fit misses them by
    percents)."""
    rows = synthetic(2e-6, B_CP, 5e-7, 4e-3, e=E_CP)
    if outlier:
        rows[5][3] *= 3.0
    prof = fit(rows, LLM, recompute="none", bytes_per_element=4, max_cp=8)
    got = prof.pop("fit")
    errors = [abs(p["rel_error"]) for i, p in enumerate(got["points"]) if not (outlier and i == 5)]
    tol = 2e-3 if outlier else 1e-6
    assert max(errors) < tol
    if outlier:
        assert got["points"][5]["weight"] < 0.05 and got["points"][5]["rel_error"] < -0.6
        monkeypatch.setattr(calibrate, "HUBER", np.inf)   # plain least squares: bent by it
        bent = fit(rows, LLM, recompute="none", bytes_per_element=4, max_cp=8)["fit"]["points"]
        assert max(abs(p["rel_error"]) for i, p in enumerate(bent) if i != 5) > 1e-2
    np.testing.assert_allclose([got["coefficients"][k] for k in "ago"], [2e-6, 5e-7, 4e-3],
                               rtol=tol * 10)
    assert got["coefficients"]["b"] == pytest.approx(B_CP, rel=tol * 10)
    assert got["coefficients"]["e"] == pytest.approx(E_CP, rel=tol * 10)
    assert prof["cp_overhead"] == pytest.approx({c: x / LLM.num_layers for c, x in E_CP.items()},
                                                rel=tol * 10)
    assert sorted(prof["cp_attention_efficiency"]) == [2, 4, 8]
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({**prof, "fit": got}))
    cost = CostModel(LLM, load_profile(path), pp=1, tp=1, recompute="none")
    o = cost.hw.micro_batch_overhead_fwd + cost.hw.micro_batch_overhead_bwd
    for L, d, c, y in synthetic(2e-6, B_CP, 5e-7, 4e-3, e=E_CP):
        t = 3.0 * cost.fwd(d * L, d * L * L, c)[0] + o
        assert t == pytest.approx(y, rel=max(tol, 1e-5))


@pytest.mark.parametrize("recompute, k_mm, k_core", [("full", 4.0, 4.0), ("selective", 3.0, 4.0)])
def test_fit_under_recompute_divides_each_term_by_the_passes_that_ran_it(tmp_path, recompute, k_mm,
                                                                          k_core):
    """Passes measured under full recompute ran every term 4 times, under selective the matmuls 3
    and the attention core (scores, K/V traffic, per-call cost) 4 times: the fit recovers the
    forward coefficients, and the profile under the same recompute reproduces the times
    (`3 fwd + core_fwd` for selective, `4 fwd` for full: hcp/dcp/cost_model.py). Dividing the
    core by 3 under selective (the old fit) would price attention 4/3 too dear."""
    a, g, o = 2e-6, 5e-7, 4e-3
    rows = [[L, d, c, k_mm * a * d * L / c + k_core * (B_CP[c] * d * L * L / c + g * d * L * (c - 1) / c
                                                      + ({1: 0.0, **E_CP})[c]) + o]
            for L, d in grid() for c in (1, 2, 4, 8)]
    prof = fit(rows, LLM, recompute=recompute, bytes_per_element=4, max_cp=8)
    got = prof.pop("fit")
    np.testing.assert_allclose([got["coefficients"][k] for k in "ago"], [a, g, o], rtol=1e-5)
    assert got["coefficients"]["b"] == pytest.approx(B_CP, rel=1e-5)
    assert got["coefficients"]["e"] == pytest.approx(E_CP, rel=1e-5)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({**prof, "fit": got}))
    cost = CostModel(LLM, load_profile(path), pp=1, tp=1, recompute=recompute)
    for L, d, c, y in rows:
        t = (1.0 + cost.bwd_factor) * cost.fwd(d * L, d * L * L, c)[0] + o
        if recompute == "selective":
            t = t + cost.core_fwd(d * L, d * L * L, c)[0]
        assert t == pytest.approx(y, rel=1e-5)
    with pytest.raises(ValueError, match="recompute='sometimes'"):
        fit(rows, LLM, recompute="sometimes", bytes_per_element=4, max_cp=8)


def test_old_profiles_load_with_one_attention_efficiency_and_new_ones_per_cp_size(tmp_path):
    """A profile without `cp_attention_efficiency` (every profile before it) costs attention the
    same at every CP size; with it, c takes the largest listed size <= c (the smallest listed
    below all), c = 1 keeps `attention_efficiency`; a bad entry is a one-line error."""
    old = load_profile("h100")
    assert old.cp_attention_efficiency is None
    L = np.array([4096.0])
    base = CostModel(LLM, old, pp=1, tp=1, recompute="none")
    new_path = tmp_path / "new.yaml"
    text = (ROOT / "hcp/dcp/profiles/h100.yaml").read_text()
    new_path.write_text(text + "cp_attention_efficiency: {4: 0.3, 2: 0.15}\n")
    new = CostModel(LLM, load_profile(new_path), pp=1, tp=1, recompute="none")
    for c, scale in ((1, 1.0), (2, 3.0), (4, 1.5), (8, 1.5)):
        _, attn_old, _ = base._parts(L, L * L, c)
        _, attn_new, _ = new._parts(L, L * L, c)
        assert attn_new[0, 0] == pytest.approx(scale * attn_old[0, 0])
    shipped = load_profile(ROOT / "hcp/dcp/profiles/gloo_llama_tiny.yaml")   # mode=calibrate's
    assert sorted(shipped.cp_attention_efficiency) == [2, 4, 8]
    bad = tmp_path / "bad.yaml"
    bad.write_text(text + "cp_attention_efficiency: {3: 0.3}\n")
    with pytest.raises(ValueError, match=r"cp_attention_efficiency=\{3: 0.3\}: invalid value.*power of two"):
        load_profile(bad)


def test_a_coefficient_fitted_to_zero_is_a_negligible_cost():
    prof = fit(synthetic(2e-6, 3e-9, 0.0, 4e-3), LLM, "none", 4, 4)
    prof.pop("fit")
    hw = HardwareProfile(**prof)  # valid: every field in range
    assert hw.nvlink_bandwidth >= 1e17 and hw.cp_latency == 0.0


def _collectives(rank, world):
    """(busy, thread) seconds of 5 all-reduces of 16 MB and of one barrier that waits 1 s for
    rank 1 (0 for rank 1's own sleep)."""
    import time

    import torch
    import torch.distributed as dist

    from hcp.preflight.calibrate import busy_time

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
    from hcp.preflight.calibrate import MIN_LENGTH, run_calibrate

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


def test_every_cp_size_is_timed_on_the_whole_pool_in_groups(tmp_path, monkeypatch):
    """`measure` starts the pool's ranks (the largest size) for every CP size, so a micro-batch
    of c ranks is timed beside the pool's other groups as in training (a cp-1 point alone on
    2 shared cores ran 1.2-1.6x faster than beside 7 others); a group lasts as long as its
    slowest rank and the point reports the median group."""
    import hcp.launch.launch as launch

    started = []

    def fake_start(fn, nproc, payload, method):
        started.append((nproc, payload["cp"]))
        Path(payload["out"]).write_text(json.dumps([[L, d, payload["cp"], 1.0]
                                                    for L, d in payload["points"]]))

    monkeypatch.setattr(launch, "start_local_ranks", fake_start)
    cfg = compose_config(["+recipe=llama_tiny"])
    rows = calibrate.measure(cfg, str(tmp_path), [1, 2, 4], 64)
    assert started == [(4, 1), (4, 2), (4, 4)]
    assert sorted({int(r[2]) for r in rows}) == [1, 2, 4]
    assert calibrate.typical_group([1.0, 5.0, 2.0, 3.0], 2) == 4.0   # groups' slowest 5, 3
    assert calibrate.typical_group([1.0, 5.0, 2.0, 3.0], 1) == 2.5
    assert calibrate.typical_group([1.0, 5.0, 2.0, 3.0], 4) == 5.0


@pytest.mark.slow
def test_a_pool_of_two_times_cp1_and_cp2_with_real_ranks(tmp_path):
    """Two forked gloo ranks: cp 1 as two groups of one rank at once, cp 2 as one group (every
    rank creates every group in one order: no hang); every point timed."""
    cfg = compose_config(["+recipe=llama_tiny", "launcher.nproc_per_node=2"])
    rows = calibrate.measure(cfg, str(tmp_path), [1, 2], 32)
    assert [(int(L), int(d), int(c)) for L, d, c, _ in rows] == [
        (32, 1, 1), (32, 1, 2), (32, 2, 2), (64, 1, 2)]
    assert all(0 < s < 10 for *_, s in rows)


def test_calibrate_is_not_held_to_the_data_length_rule(tmp_path):
    """mode=calibrate reads no data: a cap under `data.max_seq_len` passes validation (training
    refuses it), and a cap under the grid gets calibrate's own one-line error, whose fix passes."""
    from hcp.config.errors import ConfigError
    from hcp.config.validate import validate

    small = ["+recipe=llama_tiny", "launcher.nproc_per_node=1", "trainer.micro_batch_tokens=128"]
    validate(compose_config([*small, "mode=calibrate"]), 1)
    with pytest.raises(ConfigError, match="data.max_seq_len"):
        validate(compose_config(small), 1)
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "+recipe=llama_tiny", "mode=calibrate",
                          "launcher.nproc_per_node=1", "trainer.micro_batch_tokens=8",
                          f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 2 and "trainer.micro_batch_tokens=8" in out.stderr
    assert "shortest document is 32" in out.stderr and "max_seq_len" not in out.stderr, out.stderr


def test_calibration_times_the_runs_precision_and_backend(monkeypatch):
    """Calibration computes as training does: the backend resolved from the device, the compute
    dtype and the CP pool (flash on a bf16 CUDA run without CP, hcp's CP attention with a pool),
    and the pass under the run's autocast, so the attention gets bf16 q/k/v (it timed fp32:
    on CUDA the math kernel, [n, Hq, Lq, Lk] scores in memory)."""
    import torch

    import hcp.model.backends as backends
    from hcp.model.llama import LlamaDecoder

    bf16 = compose_config(["+recipe=llama_tiny", "precision=bf16"])
    monkeypatch.setattr(backends, "_importable", lambda name: name == "flash")
    cuda = torch.device("cuda")
    assert calibrate.calibration_backend(bf16, cuda, 1)[0] == "flash"
    assert calibrate.calibration_backend(bf16, cuda, 4)[0] == "torch"       # the dynamic-CP pool
    fp32 = compose_config(["+recipe=llama_tiny"])
    assert calibrate.calibration_backend(fp32, cuda, 1)[0] == "torch"

    seen = []
    attention = backends.thd_attention
    monkeypatch.setattr(backends, "thd_attention",
                        lambda q, *a, **k: seen.append(q.dtype) or attention(q, *a, **k))
    cpu = torch.device("cpu")
    backend, precision = calibrate.calibration_backend(bf16, cpu, 1)
    model = LlamaDecoder(bf16.llm, attention_backend=backend)
    x = torch.randn(16, bf16.llm.hidden_size, requires_grad=True)
    secs = calibrate.timed_pass(model, precision, cpu, x, torch.arange(8).repeat(2),
                                torch.tensor([0, 8, 16], dtype=torch.int32), 8, (8, 8))
    assert secs > 0 and set(seen) == {torch.bfloat16} and x.grad is not None
