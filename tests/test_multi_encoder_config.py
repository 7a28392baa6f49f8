"""Several encoders (issue 14 part 3): the two-encoder recipe's config, data and plan mode.
Named modules read their own inputs and every stream is planned (`plan_step` with one length
index per stream); bad names, edges and layouts of named modules fail before ranks start with
the field named; plan mode lists every module; training refuses what several encoders do not
run yet (with the field), and named modules take their own optimizer settings."""
import pytest

from hcp.config.modules import Stream, streams
from hcp.plan.step import plan_step
from hcp.config.specs import resolve_modules
from cfg_utils import with_specs

RECIPE = ["+recipe=llava_tiny_two_encoders"]
BRANCH = ["+projectors={pooled:{pool:2,layout:{tp:${vision.layout.tp}}}}", "graph.edges=[[vision,projector],[vision,pooled],[projector,llm],"
          "[pooled,llm],[vision2,projector2],[projector2,llm]]"]


def _cfg(*overrides):
    from cfg_utils import compose_cfg
    return compose_cfg([*RECIPE, *overrides])


def test_two_encoder_recipe_reads_both_inputs_and_plans_every_stream():
    from hcp.config.validate import validate
    from hcp.data.build import build_datasets, stream_token_ids
    from hcp.plan.lengths import stream_indexes

    cfg = _cfg(*BRANCH, "llm.layout.tp=2", "encoders.vision2.layout.tp=1")
    layouts = validate(cfg, 4)
    assert {m: (lay.tp, lay.dp) for m, lay in layouts.items()} == {
        "vision": (2, 2), "vision2": (1, 4), "projector": (2, 2), "projector2": (1, 4), "pooled": (2, 2),
        "llm": (2, 2)}
    flows = streams(cfg.graph.edges)
    assert flows == (Stream("projector", "vision"), Stream("pooled", "vision"), Stream("projector2", "vision2"))
    tok, train, held_out = build_datasets(*with_specs(cfg))
    ids = stream_token_ids(resolve_modules(cfg), tok)
    assert ids == {"projector": 259, "pooled": 260, "projector2": 261} and tok.vocab_size == 262
    s = train[0]
    assert len(s.images) == 1 and len(s.inputs["vision2"]) == 1 and held_out is not None
    counts = {p: s.input_ids.count(i) for p, i in ids.items()}
    assert counts == {"projector": 16, "pooled": 4, "projector2": 4}  # 2x2 patches, 2x2 pool, 4x4 patches
    assert s.input_ids.index(ids["pooled"]) == s.input_ids.index(ids["projector"]) + 16  # one <image>, two runs
    assert train.pixel_values(s, "vision2").shape == (1, 1, 8, 8)
    rows = {f.projector: 16 if f.projector == "projector" else 4 for f in flows}
    index = stream_indexes(_First(train, 16), ids, rows,
                           {f.projector: f.encoder for f in flows})
    plan = plan_step(index["projector"], layouts, "first_fit", cfg.trainer.micro_batch_tokens, cfg.graph.edges,
                     stream_sizes=index)
    assert set(plan.tables) == {("projector", "llm"), ("pooled", "llm"), ("projector2", "llm")}
    assert plan.counts.stream_rows == {"projector": 256, "pooled": 64, "projector2": 64}
    mb = plan.rank(0).micro_batches[0]
    assert set(mb.stream_rows) == {"projector", "pooled", "projector2"}
    batch = train.collate([train[i] for i in mb.samples])
    assert set(batch.stream_masks) == {"pooled", "projector2"} and train.stream_ids == ids
    assert batch.encoder_pixels["vision2"].shape == (len(mb.samples), 1, 8, 8)
    assert batch.pixel_values.shape == (len(mb.samples), 1, 8, 8)
    a, b = mb.stream_rows["projector2"]
    assert b - a == int(batch.stream_masks["projector2"].sum())  # llm cp = 1: all of them


class _First:
    """The first n samples of a data set."""

    def __init__(self, ds, n):
        self.ds, self.n = ds, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.ds[i]


@pytest.mark.parametrize("overrides, field, text", [
    (["+encoders={llm:{}}"], "encoders.llm", "built-in"),
    (["+projectors={vision2:{}}"], "projectors.vision2", "also used"),
    (["graph.edges=[[vision,projector],[projector,llm],[vision2,llm]]"], "graph.edges", "projector"),
    (["graph.edges=[[vision,projector],[projector,llm]]"], "graph.edges", "projector2"),
    (["graph.edges=[[vision,projector],[projector,llm],[vision2,projector2],[projector2,llm],[vision,projector2]]"],
     "graph.edges", "exactly one"),
    (["projectors.projector2.pool=3"], "projectors.projector2.pool", "patch grid"),
    (["encoders.vision2.layout.tp=3"], "encoders.vision2.layout.tp", "not divisible"),
    (["projectors.projector2.layout.tp=2"], "projectors.projector2.layout", "vision2's layout"),
    (["encoders.vision2.hiden_size=3"], "encoders.vision2.hiden_size", "hidden_size"),
    (["encoders.vision2.arch=siglip"], "encoders.vision2.arch", "siglip"),
    (["vision=null", "projector=null", "graph.edges=[[vision2,projector2],[projector2,llm]]"], "vision",
     "default encoder"),
    (["placement=non_colocated", "vision.layout.num_ranks=1", "encoders.vision2.layout.num_ranks=1",
      "encoders.vision2.layout.rank_offset=4"], "encoders.vision2.layout.rank_offset", "leaves the world"),
])
def test_bad_names_edges_and_layouts_of_named_modules_are_named(overrides, field, text):
    from hcp.config.errors import ConfigError
    from hcp.config.validate import validate

    with pytest.raises(ConfigError, match=text) as err:
        validate(_cfg(*overrides), 4)
    assert err.value.field == field


@pytest.mark.slow
def test_plan_mode_lists_named_modules(tmp_path, capsys):
    from hcp.preflight.plan_mode import run_plan

    plan = run_plan(_cfg(*BRANCH), str(tmp_path))
    out = capsys.readouterr().out
    for m in ("vision2", "projector2", "pooled"):
        assert f"  {m}" in out
    assert (tmp_path / "plan.json").is_file() and plan is not None


@pytest.mark.parametrize("overrides, field", [
    (["placement=non_colocated", "vision.layout.num_ranks=1", "encoders.vision2.layout.num_ranks=1",
      "projectors.projector2.layout.num_ranks=1", "vision.layout.tp=1", "encoders.vision2.layout.tp=1",
      "projectors.projector2.layout.tp=1"], "projectors.projector2.layout"),
    (["placement=non_colocated", "vision.layout.num_ranks=1", "encoders.vision2.layout.num_ranks=1",
      "vision.layout.tp=1", "encoders.vision2.layout.tp=1", "projectors.projector2.layout.recompute=full"],
     "projectors.projector2.layout.recompute"),
    (["encoders.vision2.layout.dp_shard=true"], "encoders.vision2.layout.dp_shard"),
    (["encoders.vision2.init_from=/tmp/clip"], "encoders.vision2.init_from"),
    (["vision.layout.recompute=full"], "encoders.vision2.layout.recompute"),
])
def test_training_refuses_what_several_encoders_do_not_run_yet(overrides, field):
    from hcp.config.errors import ConfigError
    from hcp.config.validate import validate
    from hcp.train.support import check_trainable

    cfg = _cfg(*overrides)
    with pytest.raises(ConfigError) as err:
        check_trainable(cfg, resolve_modules(cfg, validate(cfg, 4)))
    assert err.value.field == field


def test_named_modules_take_their_own_optimizer_settings():
    from hcp.train.optim import module_overrides

    cfg = _cfg("encoders.vision2.optim.lr=1e-4", "projectors.projector2.optim.weight_decay=0.1")
    assert module_overrides(resolve_modules(cfg)) == {"vision2": {"lr": 1e-4}, "projector2": {"weight_decay": 0.1}}


def test_export_refuses_named_modules_instead_of_dropping_them(tmp_path):
    from hcp.config.errors import ConfigError
    from hcp.train.export import start_export

    with pytest.raises(ConfigError, match="left out") as err:
        start_export(*with_specs(_cfg(f"export.dir={tmp_path}")), str(tmp_path), None, 1)
    assert err.value.field == "graph.edges"
