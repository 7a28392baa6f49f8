"""A training sweep (`python train.py -m ...`): a point whose config breaks a rule is one
`hcp: error:` line and the sweep goes on; the sweep ends with one table of every point and exit
status 2 when a point failed (`hcp.preflight.sweep_table`)."""
import json
import os
import subprocess
import sys

from omegaconf import OmegaConf

from cfg_utils import REPO


def _job(root, num, overrides, summary=None, error=None):
    d = root / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("\n".join(f"- {o}" for o in ["logger=none", *overrides]))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    if error is not None:
        (d / "error.txt").write_text(error + "\n")


def test_a_training_sweep_ends_with_one_table_of_every_point(tmp_path, capsys):
    import pytest

    from hcp.preflight.sweep_table import TrainSweepTable

    _job(tmp_path, 0, ["optim.lr=1e-3"], {"final_loss": 2.34567, "tokens_per_s": 12345.6, "step_time_s": 0.1254})
    _job(tmp_path, 1, ["optim.lr=3e-3"], error="optim.lr=... no")
    _job(tmp_path, 2, ["optim.lr=1e-2"])  # stopped before its summary
    (tmp_path / "notes").mkdir()  # not a job folder
    config = OmegaConf.create({"mode": "train", "hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SystemExit) as e:
        TrainSweepTable().on_multirun_end(config)
    assert e.value.code == 2
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "training sweep (3 runs, 2 failed, best first by final_loss (lower is better))"
    assert [line.split() for line in out[1:5]] == [
        ["run", "status", "eval", "accuracy", "eval", "loss", "final", "loss", "tokens/s", "step",
         "time", "s"],
        ["optim.lr=1e-3", "ok", "-", "-", "2.3457", "12,346", "0.125"],
        ["optim.lr=3e-3", "error", "-", "-", "-", "-", "-"],
        ["optim.lr=1e-2", "no", "summary", "-", "-", "-", "-", "-"]]
    assert out[5] == "error optim.lr=3e-3: optim.lr=... no"
    assert (tmp_path / "sweep_summary.txt").read_text().splitlines() == out[:-1]
    TrainSweepTable().on_multirun_end(OmegaConf.merge(config, {"mode": "plan"}))  # plan sweeps: their own table
    assert capsys.readouterr().out == ""


def test_a_sweep_is_ranked_by_its_eval_accuracy_not_its_last_training_loss(tmp_path, capsys):
    """lr 3e-3 ends with the lower training loss but the worse eval accuracy: the table shows
    both eval metrics and puts lr 1e-3 first; without accuracy, eval loss ranks."""
    from hcp.preflight.sweep_table import TrainSweepTable

    common = {"tokens_per_s": 100.0, "step_time_s": 0.5}
    _job(tmp_path, 0, ["optim.lr=1e-3"],
         {"final_loss": 0.883, "eval/loss": 1.9, "eval/answer_accuracy": 0.274, **common})
    _job(tmp_path, 1, ["optim.lr=3e-3"],
         {"final_loss": 0.526, "eval/loss": 1.7, "eval/answer_accuracy": 0.063, **common})
    config = OmegaConf.create({"mode": "train", "hydra": {"sweep": {"dir": str(tmp_path)}}})
    TrainSweepTable().on_multirun_end(config)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("training sweep (2 runs, 0 failed, best first by eval/answer_accuracy "
                      "(higher is better))")
    assert [line.split()[:5] for line in out[2:4]] == [
        ["optim.lr=1e-3", "ok", "0.274", "1.9000", "0.8830"],
        ["optim.lr=3e-3", "ok", "0.063", "1.7000", "0.5260"]]
    for n in (0, 1):  # no accuracy (a text-only recipe): the lower eval loss ranks first
        path = tmp_path / str(n) / "summary.json"
        kept = {k: v for k, v in json.loads(path.read_text()).items() if "accuracy" not in k}
        path.write_text(json.dumps(kept))
    TrainSweepTable().on_multirun_end(config)
    out = capsys.readouterr().out.splitlines()
    assert "best first by eval/loss (lower is better)" in out[0]
    assert out[2].startswith("optim.lr=3e-3")


def test_a_bad_sweep_point_is_one_line_and_the_sweep_still_ends_with_its_table(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "-m", "llm.layout.tp=3,5",
                           "logger=none", f"hydra.sweep.dir={tmp_path}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Error executing job" not in proc.stderr and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hcp: error:")]
    assert [e.split(":")[2].strip() for e in errors] == ["llm.layout.tp=3", "llm.layout.tp=5"]
    assert "training sweep (2 runs, 2 failed)" in proc.stdout
    assert (tmp_path / "sweep_summary.txt").is_file() and (tmp_path / "0" / "error.txt").is_file()
