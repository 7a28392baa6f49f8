"""NCCL-safe group creation (hcp.parallel.groups), pure: no process starts. For every recipe of
recipes/ at its full size, under both placements where it has an encoder, each rank's calls
to `torch.distributed.new_group` are recorded (monkeypatched, with the rank): with NCCL's
`ncclCommSplit` every rank of the world must create the same groups in the same order, so the
world-wide calls must be identical on every rank, and the only rank-local call allowed is the
rank's own stand-in group of one rank (no communicator)."""
import pytest
import torch.distributed as dist

from cfg_utils import compose_cfg
from hcp.config.layouts import check_layouts, world_size_of
from hcp.config.recipes import recipe_names
from hcp.parallel.groups import SELF_BACKEND, ProcessGroupRegistry

RECIPES = recipe_names()
NON_COLOCATED = {  # each recipe's placement=non_colocated overrides (its header's); None: no encoder
    "internvit6b_llama70b": ["vision.layout.num_ranks=32", "vision.layout.recompute=none"],
    "internvl_tiles_cp": ["vision.layout.num_ranks=64"],
    "internvl_tiles_tiny": ["vision.layout.num_ranks=4", "vision.layout.tp=2", "launcher.nproc_per_node=6"],
    "llama13b_dynamic_cp": None,
    "llama_tiny": None,
    "llava_hetero": ["vision.layout.num_ranks=16", "llm.layout.pp=3", "llm.layout.pp_layers=[13,14,13]"],
    "llava_tiny": ["vision.layout.num_ranks=2"],
    "llava_tiny_hetero": ["vision.layout.num_ranks=2", "launcher.nproc_per_node=6"],
    "llava_tiny_two_encoders": ["vision.layout.num_ranks=1", "encoders.vision2.layout.num_ranks=1"],
}
CASES = [(r, p) for r in RECIPES for p in ("colocated", "non_colocated")
         if p == "colocated" or NON_COLOCATED.get(r) is not None]


def test_every_recipe_says_whether_it_runs_non_colocated():
    assert sorted(NON_COLOCATED) == RECIPES  # a new recipe: add its non-colocated overrides here
    for recipe, overrides in NON_COLOCATED.items():
        if overrides is None:  # only a text-only LM has no island to cut
            assert compose_cfg([f"+recipe={recipe}"], resolve=False).vision is None, recipe


def record_creations(layouts, dynamic, world, monkeypatch):
    """Per rank: (its new_group calls as (ranks, backend, local), the handle each call returned
    by rank list, its registry)."""
    calls, made = [], {}

    def new_group(ranks=None, backend=None, use_local_synchronization=False, **kwargs):
        calls.append((tuple(ranks), backend, use_local_synchronization))
        return made.setdefault(tuple(ranks), object())  # a distinct handle per rank list

    monkeypatch.setattr(dist, "new_group", new_group)
    out = []
    for rank in range(world):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, r=rank: r)
        calls.clear()
        made.clear()
        registry = ProcessGroupRegistry(layouts, dynamic)
        out.append((list(calls), dict(made), registry))
    return out


@pytest.mark.parametrize("recipe,placement", CASES)
def test_every_rank_creates_the_same_groups_in_the_same_order(recipe, placement, monkeypatch):
    overrides = [f"+recipe={recipe}"]
    if placement == "non_colocated":
        overrides += ["placement=non_colocated", *NON_COLOCATED[recipe]]
    cfg = compose_cfg(overrides, resolve=False)
    world = world_size_of(cfg)
    layouts = check_layouts(cfg, world)
    dynamic = ("llm",) if cfg.packing == "dynamic_cp" else ()
    per_rank = record_creations(layouts, dynamic, world, monkeypatch)
    sequences = [[c for c in calls if c != ((rank,), SELF_BACKEND, True)]  # less its own stand-in
                 for rank, (calls, _, _) in enumerate(per_rank)]
    for rank, sequence in enumerate(sequences):
        assert sequence == sequences[0], f"{recipe} {placement}: rank {rank} creates other groups than rank 0"
    assert sequences[0] and all(len(ranks) > 1 and backend is None and not local
                                for ranks, backend, local in sequences[0])  # world-wide, >= 2 ranks
    for rank, (calls, made, registry) in enumerate(per_rank):
        assert calls.count(((rank,), SELF_BACKEND, True)) <= 1 and registry.entries()
        for module, kind, size, ranks in registry.entries():  # the group made for its rank list
            assert rank in ranks and registry.group(module, kind, size) is made[ranks]
