"""Resume under another layout, through the CLI: a checkpoint saved at one layout continues at
another with the uninterrupted run's losses (1e-4), no sample repeated or skipped (the data
position is the step), and the log names both layouts and the RNG streams derived anew."""
import json
import os
import subprocess
import sys

import pytest

from cfg_utils import REPO

RUN = ["+recipe=llama_tiny", "logger=none", "trainer.log_every=1", "trainer.eval_every=0",
       "trainer.eval_samples=8", "trainer.progress_bar=false", "trainer.global_batch_size=8",
       "data.max_seq_len=256", "trainer.micro_batch_tokens=512", "trainer.max_steps=4"]


def _run(run_dir, *args):
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "train.py", *RUN, *args, f"hydra.run.dir={run_dir}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    return losses, proc.stdout


def _whole(tmp_path, name, *layout):
    """An uninterrupted 4-step run that also saves at step 2."""
    return _run(tmp_path / name, "trainer.save_every=2", *layout)[0]


def _resumed(tmp_path, name, source, *layout):
    losses, log = _run(tmp_path / name, f"resume={tmp_path / source / 'checkpoints' / 'step_00000002'}",
                       *layout)
    assert sorted(losses) == [3, 4]  # steps 3 and 4 only: the data position came with the step
    return losses, log


def _same(resumed, whole):
    for step in (3, 4):
        assert resumed[step] == pytest.approx(whole[step], rel=1e-4), step


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dp4_resumes_at_tp2_x_dp2_and_at_2_ranks(tmp_path):
    whole = _whole(tmp_path, "dp4", "launcher.nproc_per_node=4")
    tp2, log = _resumed(tmp_path, "tp2dp2", "dp4", "launcher.nproc_per_node=4", "llm.layout.tp=2")
    _same(tp2, whole)
    assert "resumed from step 2 saved at dp4, now tp2 x dp2" in log
    assert "RNG streams do not carry over to another layout: derived from (seed, step, rank)" in log
    two, log = _resumed(tmp_path, "dp2", "dp4", "launcher.nproc_per_node=2")
    _same(two, whole)
    assert "resumed from step 2 saved at dp4, now dp2" in log


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pp2_resumes_at_pp1_and_dp_shard_on_resumes_off(tmp_path):
    pp2 = _whole(tmp_path, "pp2", "launcher.nproc_per_node=2", "llm.layout.pp=2")
    pp1, log = _resumed(tmp_path, "pp1", "pp2", "launcher.nproc_per_node=2")
    _same(pp1, pp2)
    assert "resumed from step 2 saved at pp2, now dp2" in log
    shard = _whole(tmp_path, "shard", "launcher.nproc_per_node=2", "llm.layout.dp_shard=true")
    plain, log = _resumed(tmp_path, "plain", "shard", "launcher.nproc_per_node=2")
    _same(plain, shard)
    assert "resumed from step 2 saved at dp2 (dp_shard), now dp2" in log
    same, log = _resumed(tmp_path, "same", "shard", "launcher.nproc_per_node=2", "llm.layout.dp_shard=true")
    _same(same, shard)
    assert "resumed from step 2 saved at dp2 (dp_shard) (" in log and "derived" not in log
