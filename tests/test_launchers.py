"""The sbatch examples in launchers/ are what `python -m hcp.launch.sbatch --dry-run` writes for
their overrides (with `python`, `train.py` and `outputs/` relative to the repository root, where
they are submitted from), and bash parses each. Regenerate them with
`PYTHONPATH=. python tests/test_launchers.py`."""
import os
import shlex
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cfg_utils import REPO  # noqa: E402

EXAMPLES = {
    "llama13b_dynamic_cp_h100.sbatch": ["+recipe=llama13b_dynamic_cp", "launcher=slurm_h100"],
    "llama13b_dynamic_cp_h100_torchrun.sbatch": ["+recipe=llama13b_dynamic_cp",
                                                 "launcher=slurm_h100",
                                                 "launcher.slurm.launch=torchrun"],
    "llama_tiny_cpu.sbatch": ["+recipe=llama_tiny", "launcher=slurm_cpu"],
}
"""launchers/ file -> the overrides it runs."""


def example(name: str) -> str:
    """launchers/NAME's text: `hcp.launch.sbatch.render` of its overrides, relative paths."""
    from hcp.config.compose import compose_config
    from hcp.launch.sbatch import render
    from hcp.launch.slurm import check_job

    overrides = EXAMPLES[name]
    cfg = compose_config(overrides)
    lc = cfg.launcher
    check_job(cfg, lc.nnodes, lc.nproc_per_node, lc.slurm.gpus_per_node)
    script = render(cfg, overrides, "outputs/slurm-$SLURM_JOB_ID", "outputs/slurm-%j.out",
                    name.split(".")[0], python="python")
    script = script.replace(shlex.quote(os.path.join(REPO, "train.py")), "train.py")
    head, rest = script.split("\n", 1)
    return (f"{head}\n# An example: `sbatch launchers/{name}` from the repository root (the\n"
            "# helper below writes the same script with absolute paths and submits it)\n" + rest)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_is_what_the_sbatch_helper_writes_and_bash_parses_it(name):
    path = os.path.join(REPO, "launchers", name)
    with open(path) as f:
        text = f.read()
    assert text == example(name), (f"launchers/{name} drifted: "
                                   "PYTHONPATH=. python tests/test_launchers.py")
    assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0
    assert "#SBATCH --requeue" in text and "resume=auto" in text and "train.py " in text


def test_launchers_holds_the_examples_and_its_readme_names_each():
    files = set(os.listdir(os.path.join(REPO, "launchers")))
    assert files == {"README.md", *EXAMPLES}, files
    with open(os.path.join(REPO, "launchers", "README.md")) as f:
        readme = f.read()
    assert all(f"`{name}`" in readme for name in EXAMPLES)


if __name__ == "__main__":
    for name in EXAMPLES:
        with open(os.path.join(REPO, "launchers", name), "w") as f:
            f.write(example(name))
        print(f"launchers/{name} written")
