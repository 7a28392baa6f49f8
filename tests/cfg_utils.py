"""Compose the project's Hydra config in tests exactly as `train.py` does."""
from __future__ import annotations

import os

from hcp.config.compose import CONF_DIR, compose_config

REPO = os.path.dirname(CONF_DIR)


def compose_cfg(overrides=(), resolve=True, run_dir="/tmp/hcp-test-run"):
    """`hcp.config.compose.compose_config` with a test run directory."""
    return compose_config(overrides, run_dir=run_dir, resolve=resolve)


def compose_container(overrides, run_dir) -> dict:
    """`compose_cfg(overrides)` resolved into a plain dict (what forked ranks receive), with
    the run under `run_dir`."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose_cfg(overrides, run_dir=str(run_dir)), resolve=True)


def long_tail_corpus(root, n: int = 96):
    """`n` source files in `root` (created): mostly short (8-100 bytes), every eighth long
    (300-500), so a global batch mixes documents that fit one rank at 128 tokens per rank
    with ones that need a CP group of 4 (dynamic CP then really uses several CP sizes)."""
    import numpy as np

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        size = int(rng.integers(300, 500) if i % 8 == 0 else rng.integers(8, 100))
        with open(os.path.join(root, f"f{i:03d}.py"), "w") as f:
            f.write("".join(rng.choice(list("abcdef ghij=()\n"), size)))
    return root


def long_tail_llava(root) -> list[str]:
    """LLaVA-JSON records in `root` (a pathlib.Path) with a long tail of lengths, for the tiny
    LLaVA: 48 records, 8x8 images on most (16 image rows each), answers of 2-40 bytes, every
    fourth 150-200 bytes, every sixth text-only. Returns the `data.path` and
    `data.image_folder` overrides (use with `data=llava_json data.system_prompt=''`)."""
    import json

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1)
    records = []
    for i in range(48):
        n = int(rng.integers(150, 200) if i % 4 == 0 else rng.integers(2, 40))
        answer = "".join(rng.choice(list("abcdefgh "), n))
        human = "<image>\nwhat is it?" if i % 6 else "say something"
        rec = {"id": f"s{i}", "conversations": [{"from": "human", "value": human},
                                                 {"from": "gpt", "value": answer}]}
        if i % 6:
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(root / f"{i}.png")
            rec["image"] = f"{i}.png"
        records.append(rec)
    (root / "d.json").write_text(json.dumps(records))
    return [f"data.path={root / 'd.json'}", f"data.image_folder={root}"]


def train_cli(run_dir, args, timeout: float = 400) -> list[dict]:
    """Run `python train.py *args hydra.run.dir=run_dir` from the repository; return the
    records of its metrics.jsonl. Fails the test with the end of stderr when the run fails."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}"],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f)]


CLI_RUN = ("trainer.max_steps=10", "logger=none", "trainer.log_every=1", "trainer.eval_every=0",
           "trainer.eval_samples=16", "trainer.progress_bar=false")
"""Overrides of a short CLI training run whose every step's loss is logged."""


def cli_run(run_dir, recipe: str, extra=(), timeout: float = 400):
    """Run `python train.py +recipe=RECIPE` with `CLI_RUN` and `extra` overrides into `run_dir`
    (a pathlib.Path, `train_cli`) and return `run_dir`."""
    train_cli(run_dir, [f"+recipe={recipe}", *CLI_RUN, *extra], timeout)
    return run_dir


def logged_steps(run_dir) -> list[dict]:
    """A run's logged training steps (metrics.jsonl records with a loss)."""
    import json

    with open(run_dir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def run_summary(run_dir) -> dict:
    """A run's summary.json (final loss, evaluation metrics, throughput)."""
    import json

    with open(run_dir / "summary.json") as f:
        return json.load(f)


def cli_metrics(run_dir, recipe: str, extra=(), timeout: float = 400) -> list[dict]:
    """`cli_run`, then its logged steps (metrics.jsonl records with a loss)."""
    return logged_steps(cli_run(run_dir, recipe, extra, timeout))


def with_specs(cfg):
    """(cfg, its `hcp.config.specs.ModuleSpecs` without layouts): the arguments of
    `prepare_data` and `build_datasets`."""
    from hcp.config.specs import resolve_modules

    return cfg, resolve_modules(cfg)


def resume_check(cfg) -> None:
    """`hcp.train.checkpoint.check_resume` of a composed training `cfg`, as `hcp.entry.run`
    calls it before ranks start."""
    from hcp.config.settings import CheckpointSpec
    from hcp.train.checkpoint import check_resume

    check_resume(CheckpointSpec.of(cfg), with_specs(cfg)[1], cfg.trainer.max_steps)
