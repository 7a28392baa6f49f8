"""Shared pytest set-up: one intra-op thread so that forked gloo ranks never inherit a
running OpenMP pool (docs/design.md section 8), and the tests folder importable for helpers."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def llava_tiny_cli(tmp_path_factory):
    """The run directory of 10 CLI steps of `+recipe=llava_tiny` (`cfg_utils.cli_run`), run once
    per session: the reference of the CLI comparisons of other layouts."""
    from cfg_utils import cli_run

    return cli_run(tmp_path_factory.mktemp("llava_tiny"), "llava_tiny")


@pytest.fixture(scope="session")
def two_encoder_reference(tmp_path_factory):
    """One step + AdamW of the two-encoder model (join + branch) on one process
    (`test_hetero_parity._step` on its TWO_ENCODERS config): the reference of the colocated and
    island parity tests of several encoders, computed once per session."""
    from cfg_utils import compose_container
    from dist_utils import run_ranks
    from test_hetero_parity import TWO_ENCODERS, _step

    run = tmp_path_factory.mktemp("two_encoder_ref")
    return run_ranks(_step, 1, compose_container(TWO_ENCODERS, run), str(run))[0]
