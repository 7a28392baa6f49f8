"""`mode=rehearse rehearse.device=cuda` (issue 39 section 4): the ranks on fake CUDA tensors, with
device reads, host-to-device copies, device mismatches, attention kernels and wire dtypes
recorded (hcp/preflight/rehearse/device.py). Fake CUDA needs the shim preloaded before torch
starts (hcp/preflight/rehearse/fake_cuda.py), so the checks run in a child process
(tests/fake_cuda_probe.py); this process is the CPU wheel without it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hcp.preflight.rehearse import fake_cuda
from tests.cfg_utils import REPO, compose_cfg

PROBE = os.path.join(REPO, "tests", "fake_cuda_probe.py")
TINY = ("llama_tiny", "llava_tiny", "llava_tiny_hetero", "llava_tiny_two_encoders",
        "internvl_tiles_tiny")
FAST = ("rehearse.ranks=[0]", "rehearse.steps=2", "trainer.global_batch_size=8", "rehearse.jobs=1")


def _probe(*args, timeout=900):
    env = fake_cuda.preloaded_env(dict(os.environ, PYTHONPATH=REPO))
    proc = subprocess.run([sys.executable, PROBE, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_cpu_wheel_cannot_run_a_backward_on_fake_cuda_without_the_shim():
    """Why the shim exists: torch 2.13's CPU wheel has no CUDA accelerator, so a backward on
    fake CUDA tensors cannot run here (autograd's `InputBuffer::add` asks for one)."""
    if not fake_cuda.needed():
        pytest.skip("a CUDA build of torch traces fake CUDA tensors itself")
    assert not fake_cuda.active() and torch.accelerator.current_accelerator() is None


@pytest.mark.timeout(300)
def test_the_checker_counts_each_planted_event():
    """A tiny step on fake CUDA with one planted event of each kind, in a micro-batch of steps
    1 and 2: a `.item()` (a device read, the one the rehearsal fails after warm-up), a pageable
    and a pinned host-to-device copy, a CPU operand beside a CUDA one, a fp32 CP attention call
    (the math fallback) and a bf16 `F.scaled_dot_product_attention` (flash); autocast runs in
    bf16 and the backward reaches the CUDA weight."""
    out = _probe("planted")
    ev = out["events"]
    assert out["autocast_dtypes"] == ["torch.bfloat16"] * 2 and out["grad"] == "cuda:0"
    assert ev["device read|item/bool/int/float"] == [0, 2, 0]
    assert ev["H2D copy|pageable, non_blocking"] == [0, 2, 0] and ev["H2D copy|pinned"] == [0, 2, 0]
    assert ev["device mismatch|add.Tensor on cuda and cpu tensors"] == [0, 2, 0]
    assert ev["attention|math float32 (CP kernel fallback)"] == [0, 2, 0]
    assert ev["attention|flash bfloat16 (F.sdpa, predicted)"] == [0, 2, 0]
    assert out["flagged"] == 1  # step 2's read; step 1 is the warm-up
    assert out["errors"] == ["DataDependentOutputException", "FakeTensorDeviceMismatchError"] * 2


def test_a_read_in_a_micro_batch_after_warm_up_fails_the_rehearsal():
    from hcp.preflight.rehearse.device import READ
    from hcp.preflight.rehearse.report import find_mismatches
    from hcp.preflight.rehearse.runner import RankResult

    warm = {(1, 0, READ, "item/bool/int/float", "hcp/x.py:3"): 1,
            (2, None, READ, "tolist", "hcp/y.py:9"): 1}
    assert find_mismatches({0: RankResult(0, device_events=warm)}, 1, 80.0) == []
    late = {**warm, (2, 1, READ, "nonzero", "hcp/z.py:5"): 2}
    (bad,) = find_mismatches({0: RankResult(0, device_events=late)}, 1, 80.0)
    assert bad.what == "device read" and bad.sides[0] == "hcp/z.py:5 nonzero x2"


def test_sdpa_kernel_follows_torchs_rules():
    from hcp.preflight.rehearse.device import sdpa_kernel

    q = lambda dtype, d=64: torch.empty(1, 2, 16, d, dtype=dtype)  # noqa: E731
    assert sdpa_kernel(q(torch.bfloat16), q(torch.bfloat16), None) == "flash"
    mask = torch.ones(16, 16, dtype=torch.bool)
    assert sdpa_kernel(q(torch.bfloat16), q(torch.bfloat16), mask) == "efficient"
    assert sdpa_kernel(q(torch.float32), q(torch.float32), None) == "efficient"
    assert sdpa_kernel(q(torch.float32, 6), q(torch.float32, 6), None) == "math"
    assert sdpa_kernel(q(torch.float64), q(torch.float64), None) == "math"


def test_bad_device_names_field_value_and_fix():
    from hcp.config.errors import ConfigError
    from hcp.preflight.rehearse import check_rehearse

    with pytest.raises(ConfigError) as err:
        check_rehearse(compose_cfg(["rehearse.device=tpu"]), 4)
    said = str(err.value)
    assert said.startswith("rehearse.device='tpu'") and "rehearse.device=cuda" in said


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_tiny_recipes_rehearse_on_fake_cuda(tmp_path):
    """Rank 0 of every tiny recipe, two steps on fake CUDA (bf16: the flash path): no mismatch (no
    device read inside a micro-batch after warm-up), every upload of the step pinned (through
    hcp.parallel.upload; none from pageable memory) and every attention call's kernel bf16."""
    groups = [" ".join([str(tmp_path / r), f"+recipe={r}", "precision=bf16", *FAST]) for r in TINY]
    for recipe, out in zip(TINY, _probe("rehearse", *" -- ".join(groups).split())):
        assert out["mismatches"] == [], (recipe, out["printed"])
        (rank,) = out["ranks"].values()
        rows = {(k, d): (a, b, c, sites) for k, d, a, b, c, sites in rank["device_events"]}
        h2d = {d: sites for (k, d), (*_, sites) in rows.items() if k == "H2D copy"}
        assert list(h2d) == ["pinned"], (recipe, h2d)
        assert all(site.startswith("hcp/parallel/upload.py:") for site in h2d["pinned"]), h2d
        kernels = {d for k, d in rows if k == "attention"}
        assert kernels and all("bfloat16" in d for d in kernels), (recipe, kernels)
        assert "what it checks" in out["printed"] and "cannot" in out["printed"]


@pytest.mark.slow
@pytest.mark.full_size
@pytest.mark.timeout(600)
def test_a_full_size_role_rehearses_on_fake_cuda(tmp_path):
    """llama13b_dynamic_cp's rank 0 (stage 0 of PP 8, CP pool position 0), two steps on fake
    CUDA: bf16 CP attention runs flash, the collectives carry bf16 activations or fp32
    gradients, and no device read happens inside a micro-batch after warm-up."""
    (out,) = _probe("rehearse", str(tmp_path), "+recipe=llama13b_dynamic_cp", *FAST)
    print(out["printed"])
    assert out["mismatches"] == [], out["printed"]
    rows = {(k, d) for k, d, *_ in out["ranks"]["0"]["device_events"]}
    assert ("attention", "flash bfloat16") in rows, rows
