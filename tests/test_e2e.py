"""`python train.py` end to end, as a user runs it (subprocesses, real ranks, real data)."""
import glob
import json
import os
import subprocess
import sys

import pytest

from cfg_utils import REPO

QUICK = ["trainer.max_steps=4", "trainer.log_every=2", "trainer.eval_every=0", "trainer.eval_samples=16",
         "trainer.progress_bar=false", "launcher.nproc_per_node=2"]


def _run(args, timeout=300):
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_short_run_writes_metrics_summary_checkpoint_config_and_wandb(tmp_path):
    run_dir = tmp_path / "run"
    out = _run([*QUICK, "trainer.progress_bar=true", f"hydra.run.dir={run_dir}"]).stdout.splitlines()
    # stdout is a pipe here (a SLURM .out file): plain lines, no bar; where the run went, twice
    assert out[0] == f"hcp: run directory {run_dir}" and out[-1] == f"hcp: run finished; outputs in {run_dir}"
    assert [l.split(" | ")[0] for l in out if l.startswith("step ")] == ["step 2/4", "step 4/4", "step 4/4"]
    first = next(l for l in out if l.startswith("step 2/4"))
    assert [f.split()[0] for f in first.split(" | ")[1:]] == ["loss", "lr", "grad_norm", "tokens/s", "step_time", "mem"]
    assert f"checkpoint step 4: {run_dir}/checkpoints/step_00000004" in out
    assert any(l.startswith("wandb: offline") for l in out) and out[-2].startswith(f"wandb: offline run; upload "
                                                                                     f"it with: wandb sync {run_dir}/wandb/")
    assert "\r" not in "".join(out)
    metrics = [json.loads(l) for l in open(run_dir / "metrics.jsonl")]
    steps = [m["step"] for m in metrics if "loss" in m]
    assert steps == [2, 4] and all(m["loss"] > 0 and m["tokens_per_s"] > 0 for m in metrics if "loss" in m)
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= metrics[0].keys()
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["steps"] == 4 and summary["eval/samples"] == 16 and "eval/answer_accuracy" in summary
    assert [d for d in os.listdir(run_dir / "checkpoints") if d.startswith("step_")] == ["step_00000004"]
    assert (run_dir / "config_resolved.yaml").exists()
    assert glob.glob(str(run_dir / "wandb" / "offline-run-*"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multirun_sweep_gives_each_job_its_own_ranks_and_run_dir(tmp_path):
    _run(["-m", "optim.lr=1e-3,3e-3", *QUICK, "trainer.max_steps=2", "logger=none",
          f"hydra.sweep.dir={tmp_path}"])
    lrs = []
    for job in ("0", "1"):
        summary = json.load(open(tmp_path / job / "summary.json"))
        assert summary["steps"] == 2
        first = json.loads(open(tmp_path / job / "metrics.jsonl").readline())
        lrs.append(first["lr"])
    assert lrs[1] == pytest.approx(3 * lrs[0])


def test_bad_config_fails_before_ranks_start_with_field_name(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "train.py", "trainer.micro_batch_tokens=10",
                           f"hydra.run.dir={tmp_path}/run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "trainer.micro_batch_tokens=10" in proc.stderr
    assert not (tmp_path / "run").exists()  # a failed start leaves no run directory behind


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_main_job_learns_to_read_digits(tmp_path):
    """The README's main job, unchanged: held-out answer accuracy >= 0.8 (chance is 0.1)."""
    _run([f"hydra.run.dir={tmp_path}", "logger=none", "trainer.progress_bar=false"], timeout=600)
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["eval/samples"] == 270
    assert summary["eval/answer_accuracy"] >= 0.8, summary


def test_bad_record_stops_before_ranks_start_naming_file_and_id(tmp_path):
    from PIL import Image

    Image.new("RGB", (10, 10)).save(tmp_path / "a.png")
    turns = [{"from": "human", "value": "<image>\nhi"}, {"from": "gpt", "value": "yo"}]
    (tmp_path / "d.json").write_text(json.dumps([{"id": "ok", "image": "a.png", "conversations": turns},
                                                 {"id": "bad1", "image": "zz.png", "conversations": turns}]))
    proc = subprocess.run([sys.executable, "train.py", "data=llava_json", f"data.path={tmp_path}/d.json",
                           f"data.image_folder={tmp_path}", "logger=none", f"hydra.run.dir={tmp_path}/run"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{tmp_path}/d.json: record id='bad1': missing image" in proc.stderr
    assert "Traceback" not in proc.stderr
