"""`pip install .` (not editable) into a fresh virtual environment, then the `hcp-train` console
command from another directory runs the main job with the configs shipped in the package, and
finds the recipes shipped in it (`+recipe=NAME`)."""
import json
import os
import site
import subprocess
import sys
import venv

import pytest

from cfg_utils import REPO


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """A venv that sees this interpreter's packages (torch and the other dependencies: nothing is
    downloaded) with hcp installed from a wheel of this tree; built once per test session. When
    the suite itself runs in a virtual environment, "system" site-packages are the base
    interpreter's, so a .pth file adds this interpreter's own (setuptools, wheel, torch)."""
    root = tmp_path_factory.mktemp("install")
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(root / "venv")
    py = str(root / "venv" / "bin" / "python")
    own = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(own, "suite_interpreter.pth"), "w") as f:
        f.write("\n".join(p for p in site.getsitepackages() if p != own) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--quiet", "--no-index",
                    "--no-build-isolation", REPO], check=True, env=env, timeout=120, cwd=root)
    return root, env


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hcp_train_runs_the_main_job_from_an_installed_package(installed, tmp_path):
    root, env = installed
    bin_dir = root / "venv" / "bin"
    where = subprocess.run([str(bin_dir / "python"), "-c", "import hcp.config.compose as c; print(c.CONF_DIR)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(root / "venv")) and where.endswith(os.path.join("hcp", "conf"))
    code = ("import hcp.config.recipes as r; from hcp.config.compose import compose_config as c; "
            "print(r.RECIPES_DIR); print(c(['+recipe=llava_hetero']).launcher.slurm.gpus_per_node)")
    recipe = subprocess.run([str(bin_dir / "python"), "-c", code], cwd=tmp_path, env=env,
                            capture_output=True, text=True, check=True).stdout.split()
    assert recipe == [os.path.join(os.path.dirname(where), "recipes"), "8"]  # hcp/recipes
    run_dir = tmp_path / "run"
    proc = subprocess.run([str(bin_dir / "hcp-train"), "trainer.max_steps=2", "trainer.eval_every=0",
                           "trainer.eval_samples=8", "launcher.nproc_per_node=2", "logger=none",
                           f"hydra.run.dir={run_dir}"], cwd=tmp_path, env={**env, "WANDB_MODE": "offline"},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    assert proc.stdout.splitlines()[-1] == f"hcp: run finished; outputs in {run_dir}"


@pytest.mark.parametrize("args, pytest_args", [([], ""), (["tests/test_config.py", "-x"], " tests/test_config.py -x")])
def test_test_script_runs_the_tests_named_or_else_all(tmp_path, args, pytest_args):
    """`bash scripts/test.sh tests/test_config.py` runs that file only; with no argument, the
    whole suite (testpaths). A stand-in `PYTHON` records its calls, so nothing is installed."""
    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    subprocess.run(["bash", os.path.join(REPO, "scripts", "test.sh"), *args], check=True, timeout=60,
                   env={**os.environ, "PYTHON": str(fake)})
    assert log.read_text().splitlines()[-1] == "-m pytest" + pytest_args


def test_setup_installs_the_cpu_torch_without_a_gpu_never_pypis_cuda_build(tmp_path):
    """scripts/setup.sh with no torch importable and no nvidia-smi: torch==2.13.0+cpu from pip's
    configured sources, else from PyTorch's CPU index (here the first attempt fails, as on a
    machine that only reaches PyPI); then hcp itself. A stand-in `python` records each call."""
    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$*" in
  "-c import torch") exit 1 ;;
  *"torch==2.13.0+cpu") exit 1 ;;
esac
exit 0
""")
    fake.chmod(0o755)
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "setup.sh")], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake)}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == [
        "-c import torch",
        "-m pip install --quiet torch==2.13.0+cpu",
        "-m pip install --quiet torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu",
        "-m pip install --quiet -e .[test]"]
