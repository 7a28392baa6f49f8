"""scripts/gpu_check.sh, the prepared device check (issues 10 and 39), in its CPU dry run: the
same code on tiny models, so it cannot rot before a GPU is lent (it crashed on the CP call
plan's `first` field before: nothing ran it)."""
import os
import subprocess

import pytest

from cfg_utils import REPO

LINES = ("cp attention    cpu  float32 cp4 p2p", "thd attention   cpu bfloat16",
         "te cp attention: skipped", "train step: LLaMA", "fsdp: dp_shard step of",
         "checkpoint: save peak", "calibrate: precision=bf16 exit 0",
         "device: one visible GPU", "rehearsal: device events of 2 steps", "gpu_check: OK")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_gpu_check_dry_run_runs_every_item():
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--tiny"], cwd=REPO,
                          text=True, capture_output=True, timeout=1700,
                          env=dict(os.environ, GPU_CHECK_TIMEOUT="1600"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    missing = [line for line in LINES if line not in proc.stdout]
    assert not missing, (missing, proc.stdout[-3000:])
    assert "FAIL" not in proc.stdout
