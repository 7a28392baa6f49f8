"""A `checkpoint.dir` that cannot be written stops the run before any rank starts, with one line
naming the key, the value and the fix (it used to train to the first save and lose the run)."""
import os
import subprocess
import sys

import pytest

from cfg_utils import REPO

from hcp.config.errors import ConfigError
from hcp.config.paths import check_writable


@pytest.mark.timeout(120)
def test_a_checkpoint_dir_under_a_file_fails_before_ranks_start(tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    bad = tmp_path / "afile" / "checkpoints"
    proc = subprocess.run([sys.executable, "train.py", "logger=none", f"checkpoint.dir={bad}",
                           f"hydra.run.dir={tmp_path}/run"], cwd=REPO, capture_output=True, text=True,
                          timeout=110, env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hcp: error:")]
    assert errors == [f"hcp: error: checkpoint.dir='{bad}': {tmp_path / 'afile'} is a file, not a folder, "
                      "so nothing can be saved there. Fix: set checkpoint.dir to a folder this user can "
                      "write (it is created if missing)"], proc.stderr
    assert "step" not in proc.stdout and not (tmp_path / "run").exists()  # no rank ran, nothing left


def test_a_missing_folder_under_a_writable_one_passes_and_is_not_created(tmp_path):
    check_writable("checkpoint.dir", str(tmp_path / "new" / "checkpoints"))
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_refused(tmp_path):
    os.chmod(tmp_path, 0o555)
    try:
        with pytest.raises(ConfigError, match=r"^checkpoint.dir=.*cannot write into .*Permission denied"):
            check_writable("checkpoint.dir", str(tmp_path / "checkpoints"))
    finally:
        os.chmod(tmp_path, 0o755)
