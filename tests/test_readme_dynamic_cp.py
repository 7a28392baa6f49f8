"""The dynamic-CP example of docs/dynamic_cp.md shows what it says: its steps' plans use several CP
sizes."""
import re

from cfg_utils import REPO

from hcp.config.compose import compose_config
from hcp.config.layouts import resolve_layouts, world_size_of
from hcp.config.settings import PackingSpec
from hcp.config.specs import resolve_modules
from hcp.data.build import build_datasets
from hcp.data.loader import GlobalBatchSampler
from hcp.dcp.policy import cp_histogram
from hcp.train import encoders as sides
from hcp.train.planner import StepPlanner


def readme_example() -> list[str]:
    """The overrides of the command after the `<!-- dynamic-cp-example -->` marker."""
    text = open(f"{REPO}/docs/dynamic_cp.md").read()
    block = re.search(r"<!-- dynamic-cp-example -->\s*```bash\n(.*?)```", text, re.S).group(1)
    words = block.replace("\\\n", " ").split()
    assert words[:2] == ["python", "train.py"], words
    return words[2:]


def test_the_readme_dynamic_cp_example_runs_three_cp_sizes(tmp_path):
    cfg = compose_config(readme_example(), run_dir=str(tmp_path))
    layouts = resolve_layouts(cfg, world_size_of(cfg))  # what `python train.py` starts on CPU
    specs = resolve_modules(cfg, layouts)
    tok, train_set, _ = build_datasets(cfg, specs)
    planner = StepPlanner(PackingSpec.of(cfg), specs, sides.LengthIndexes(specs, train_set, tok))
    sampler = GlobalBatchSampler(len(train_set), cfg.trainer.global_batch_size, cfg.seed)
    sizes = set()
    for step in range(cfg.trainer.max_steps):
        step_sizes = cp_histogram(planner(sampler.batch(step)).packing)
        assert len(step_sizes) >= 2, (step, step_sizes)  # every step shows more than one size
        sizes |= set(step_sizes)
    assert sizes == {"micro_batches_cp1", "micro_batches_cp2", "micro_batches_cp4"}, sizes
