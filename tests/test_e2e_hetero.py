"""Through the CLI: llava_tiny and llava_tiny_hetero (encoder dp4, LLM tp2 x cp2) log the same
losses, and the plan-ahead time is reported."""
import json
import subprocess
import sys

import pytest

from cfg_utils import REPO

RUN = ["trainer.max_steps=10", "logger=none", "trainer.log_every=1", "trainer.eval_every=0",
       "trainer.eval_samples=16", "trainer.progress_bar=false"]


def _metrics(run_dir, recipe, extra=()):
    proc = subprocess.run([sys.executable, "train.py", f"+recipe={recipe}", *RUN, *extra,
                           f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "loss" in r]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_llava_tiny_and_llava_tiny_hetero_log_the_same_losses(tmp_path):
    homogeneous = _metrics(tmp_path / "homogeneous", "llava_tiny")
    hetero = _metrics(tmp_path / "hetero", "llava_tiny_hetero", ["trainer.check_plan=true"])
    a, b = [r["loss"] for r in homogeneous], [r["loss"] for r in hetero]
    assert len(a) == 10 and a[-1] < a[0]
    assert b == pytest.approx(a, abs=1e-4)
    assert all(r["plan_s"] > 0 and 0 <= r["plan_hidden_s"] <= r["plan_s"] for r in hetero)
    assert all(r["plan_hidden_s"] > 0 for r in hetero[1:])        # planned behind the step before
