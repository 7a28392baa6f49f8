"""Resume under another layout, through the CLI: a checkpoint saved at one layout continues at
another with the uninterrupted run's losses (1e-4), no sample repeated or skipped (the data
position is the step), and the log names both layouts and the RNG streams derived anew.

The runs read a small Megatron indexed data set (`data=tokens`) written here."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cfg_utils import REPO

from hcp.data.indexed import write_indexed

RUN = ["+recipe=llama_tiny", "logger=none", "trainer.log_every=1", "trainer.eval_every=0",
       "trainer.progress_bar=false", "trainer.global_batch_size=8", "data.max_seq_len=128",
       "trainer.micro_batch_tokens=256", "data=tokens"]


def _run(run_dir, *args):
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "train.py", *RUN, *args, f"hydra.run.dir={run_dir}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    return losses, proc.stdout


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """Data, and an uninterrupted 4-step dp4 run (the reference; it saves at step 2 too)."""
    root = tmp_path_factory.mktemp("resume_layouts")
    rng = np.random.default_rng(0)
    write_indexed(str(root / "docs"), [rng.integers(0, 256, rng.integers(20, 200)) for _ in range(64)])
    data = f"data.sources=[{{path: {root / 'docs'}, weight: 1.0}}]"
    losses, _ = _run(root / "dp4", data, "trainer.max_steps=4", "trainer.save_every=2",
                     "launcher.nproc_per_node=4")
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    return root, data, losses


CASES = {  # name: (saved at, its ranks, resumed at, its ranks, log)
    "dp4_to_tp2xdp2": (None, 4, ["llm.layout.tp=2"], 4, "saved at dp4, now tp2 x dp2"),
    "4_ranks_to_2": (None, 4, [], 2, "saved at dp4, now dp2"),
    "pp2_to_pp1": (["llm.layout.pp=2"], 4, [], 4, "saved at pp2 x dp2, now dp4"),
    "dp_shard_on_to_off": (["llm.layout.dp_shard=true"], 4, [], 4, "saved at dp4 (dp_shard), now dp4"),
    # FSDP shards of TP slices, saved as DTensors over (DP x CP, TP), read back whole on every rank
    "tp2_dp_shard_to_dp4": (["llm.layout.tp=2", "llm.layout.dp_shard=true"], 4, [], 4,
                            "saved at tp2 x dp2 (dp_shard), now dp4"),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_resume_at_another_layout_continues_the_run(whole, case):
    root, data, ref = whole
    saved_at, n_saved, now, n_now, log_line = CASES[case]
    source = root / "dp4"
    if saved_at is not None:  # a 2-step run at the other layout saves the checkpoint
        source = root / f"{case}_saved"
        _run(source, data, "trainer.max_steps=2", f"launcher.nproc_per_node={n_saved}", *saved_at)
    losses, log = _run(root / case, data, "trainer.max_steps=4", f"launcher.nproc_per_node={n_now}",
                       f"resume={source / 'checkpoints' / 'step_00000002'}", *now)
    assert sorted(losses) == [3, 4]  # steps 3 and 4 only: the data position came with the step
    for step in (3, 4):
        assert losses[step] == pytest.approx(ref[step], rel=1e-4), step
    assert f"resumed from step 2 {log_line}" in log
    assert "per-rank RNG streams do not carry over to another layout: derived from (seed, step, rank)" in log


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_with_the_encoder_at_another_dp_size(tmp_path):
    """A heterogeneous LLaVA run (encoder dp4 under dp_shard: FSDP over the encoder's DP group,
    LLM tp2 x cp2) saved at step 2 resumes with the encoder at tp2 x dp2 (another DP size)
    without dp_shard and logs the uninterrupted run's losses."""
    common = ["+recipe=llava_tiny_hetero", "logger=none", "trainer.log_every=1", "trainer.eval_every=0",
              "trainer.progress_bar=false", "trainer.eval_samples=4", "trainer.max_steps=4"]

    def run(run_dir, *args):
        proc = subprocess.run([sys.executable, "train.py", *common, *args, f"hydra.run.dir={run_dir}"],
                              cwd=REPO, env={**os.environ, "WANDB_MODE": "offline"},
                              capture_output=True, text=True, timeout=500)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(run_dir / "metrics.jsonl") as f:
            return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}, proc.stdout

    ref, _ = run(tmp_path / "whole", "trainer.save_every=2", "vision.layout.dp_shard=true")
    losses, log = run(tmp_path / "resumed", "vision.layout.tp=2", "projector.layout.tp=2",
                      f"resume={tmp_path / 'whole' / 'checkpoints' / 'step_00000002'}")
    assert sorted(losses) == [3, 4]
    for step in (3, 4):
        assert losses[step] == pytest.approx(ref[step], rel=1e-4), step
    assert "resumed from step 2" in log
    saved_at, now = log.split("saved at ", 1)[1].split(", now ", 1)[0], log.split(", now ", 1)[1].split(" (/", 1)[0]
    assert "vision dp4 (dp_shard)" in saved_at and "vision tp2 x dp2" in now and "llm tp2 x cp2" in now, log
