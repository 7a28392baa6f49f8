"""Layout resolution and every layout rule of issue 3 (hcp.config.layouts).

The base config is the tiny LLaVA of the schema: vision (64 wide, 4 heads, FFN 256, 2 layers),
projector, llm (128 wide, 4 heads, 2 KV heads, FFN 384, vocab 264, 2 layers).
"""
import pytest
from omegaconf import OmegaConf

from cfg_utils import compose_cfg
from hcp.config.errors import ConfigError
from hcp.config.layouts import check_layouts, resolve_layouts, world_size_of
from hcp.config.schema import HCPConfig

def cfg_of(*dotlist: str, recipe: str | None = None):
    """The schema's defaults with `dotlist` merged; with `recipe`, the config Hydra composes."""
    if recipe:
        return compose_cfg([f"+recipe={recipe}", *dotlist])
    return OmegaConf.merge(OmegaConf.structured(HCPConfig), OmegaConf.from_dotlist(list(dotlist)))


TEXT_ONLY = ("vision=null", "projector=null", "graph.edges=[]")


def fails(field: str, world: int, *dotlist: str, match: str | None = None) -> ConfigError:
    with pytest.raises(ConfigError, match=match) as err:
        check_layouts(cfg_of(*dotlist), world)
    assert err.value.field == field
    assert "Fix:" in str(err.value)
    return err.value


# ----------------------------------------------------------------------------- resolution
def test_colocated_modules_span_the_world_and_infer_dp():
    lay = check_layouts(cfg_of("llm.layout.tp=2", "llm.layout.cp=2"), 8)
    assert [(l.rank_offset, l.num_ranks) for l in lay.values()] == [(0, 8)] * 3
    assert (lay["vision"].dp, lay["llm"].dp, lay["llm"].cp_pool) == (8, 2, 4)


def test_non_colocated_projector_joins_the_encoder_island_and_llm_takes_the_rest():
    lay = check_layouts(cfg_of("placement=non_colocated", "vision.layout.num_ranks=2",
                               "trainer.global_batch_size=24"), 8)
    assert (lay["vision"].ranks, lay["projector"].ranks, lay["llm"].ranks) == (range(0, 2), range(0, 2),
                                                                              range(2, 8))
    assert (lay["vision"].dp, lay["projector"].dp, lay["llm"].dp) == (2, 2, 6)


def test_non_colocated_explicit_offsets_are_placed_first():
    lay = resolve_layouts(cfg_of("placement=non_colocated", "llm.layout.rank_offset=0",
                                 "llm.layout.num_ranks=6", "vision.layout.rank_offset=6"), 8)
    assert (lay["llm"].ranks, lay["vision"].ranks, lay["projector"].ranks) == (range(0, 6), range(6, 8),
                                                                              range(6, 8))


def test_non_colocated_island_size_from_explicit_dp():
    lay = resolve_layouts(cfg_of("placement=non_colocated", "vision.layout.dp=4"), 8)
    assert (lay["vision"].num_ranks, lay["llm"].rank_offset, lay["llm"].num_ranks) == (4, 4, 4)


def test_projector_with_its_own_size_gets_its_own_island():
    lay = resolve_layouts(cfg_of("placement=non_colocated", "vision.layout.num_ranks=2",
                                 "projector.layout.num_ranks=2"), 8)
    assert (lay["vision"].ranks, lay["projector"].ranks, lay["llm"].ranks) == (range(0, 2), range(2, 4),
                                                                              range(4, 8))


def test_explicit_pp_layers_are_kept():
    lay = check_layouts(cfg_of("llm.num_layers=6", "llm.layout.pp=4", "llm.layout.pp_layers=[1,2,2,1]"), 8)
    assert lay["llm"].pp_layers == (1, 2, 2, 1) and lay["vision"].pp_layers == (2,)


def test_encoder_layers_stop_at_select_layer():
    lay = check_layouts(cfg_of("mode=plan", recipe="llava_hetero"), 64)
    assert lay["vision"].pp_layers == (23,)  # CLIP ViT-L/14: 24 blocks, select_layer -2
    fails("vision.layout.pp", 8, "vision.num_layers=5", "vision.select_layer=-2", "vision.layout.pp=8",
          match="has 4 layers")


def test_full_size_recipes_resolve():
    llama = check_layouts(cfg_of("mode=plan", recipe="llama13b_dynamic_cp"), 64)
    assert list(llama) == ["llm"] and (llama["llm"].dp, llama["llm"].cp_pool) == (1, 8)
    hetero = check_layouts(cfg_of("mode=plan", recipe="llava_hetero"), 64)
    assert (hetero["vision"].dp, hetero["llm"].tp, hetero["llm"].dp) == (64, 8, 2)


# ----------------------------------------------------------------------------- world size
def test_world_size_of_launcher():
    assert world_size_of(cfg_of("launcher.nnodes=2", "launcher.nproc_per_node=3")) == 6
    # auto: the cluster's GPUs per node on several nodes, on one node what `python train.py`
    # starts here (4 on CPU): plan mode plans the world training would get
    assert world_size_of(cfg_of("launcher.nnodes=2"), auto_nproc=4) == 16
    assert world_size_of(cfg_of("mode=plan", recipe="llama13b_dynamic_cp")) == 64
    assert world_size_of(cfg_of("mode=plan", "cluster.gpus_per_node=16"), auto_nproc=4) == 4


def test_world_size_must_match_the_launcher():
    fails("launcher.nproc_per_node", 8, "launcher.nproc_per_node=4", match="differs")
    fails("launcher.nnodes", 8, "launcher.nnodes=3", match="evenly")
    with pytest.raises(ConfigError):
        world_size_of(cfg_of("launcher.nproc_per_node=many"))


# ----------------------------------------------------------------------------- sizes vs ranks
def test_product_of_sizes_must_equal_rank_count():
    err = fails("llm.layout.dp", 8, "llm.layout.tp=2", "llm.layout.dp=3")
    assert "2*1*1" in str(err) and "8 ranks" in str(err)


def test_inferred_dp_error_names_the_size_the_user_set_and_its_valid_values():
    err = fails("llm.layout.cp", 8, "llm.layout.cp=3", match="not divisible")
    assert "use llm.layout.cp in [1, 2, 4, 8]" in str(err)
    err = fails("llm.layout.tp", 8, "llm.layout.tp=3", "llm.layout.cp=2", match="not divisible")
    assert "use llm.layout.tp in [1, 2, 4]" in str(err)


def test_tiny_llava_tp_error_names_the_llm_key_the_encoders_follow():
    from cfg_utils import compose_cfg

    with pytest.raises(ConfigError) as e:
        check_layouts(compose_cfg(["llm.layout.tp=3"]), 4)
    assert e.value.field == "llm.layout.tp" and "[1, 2, 4]" in str(e.value)


def test_colocated_modules_must_span_identical_ranks():
    fails("vision.layout.num_ranks", 8, "vision.layout.num_ranks=4", match="colocated")
    fails("llm.layout.rank_offset", 8, "llm.layout.rank_offset=2", match="colocated")


# ----------------------------------------------------------------------------- islands
def test_islands_must_not_overlap():
    fails("llm.layout.rank_offset", 8, "placement=non_colocated", "vision.layout.rank_offset=0",
          "vision.layout.num_ranks=4", "llm.layout.rank_offset=2", "llm.layout.num_ranks=6", match="overlaps")


def test_islands_must_not_leave_ranks_unused():
    fails("llm.layout.num_ranks", 8, "placement=non_colocated", "vision.layout.num_ranks=2",
          "llm.layout.num_ranks=4", match="unused")


def test_islands_must_stay_inside_the_world():
    fails("llm.layout.rank_offset", 8, "placement=non_colocated", "vision.layout.num_ranks=2",
          "llm.layout.rank_offset=6", "llm.layout.num_ranks=4", match="leaves the world")
    # the island of a set size is the one named (the LLM's is inferred), with a size that fits
    fails("vision.layout.num_ranks", 8, "placement=non_colocated", "vision.layout.num_ranks=8",
          match=r"already take 8 of 8 ranks, leaving none for the llm island, which needs at least tp \* cp \* pp = 1"
                r".*use vision.layout.num_ranks in \[1, 2, 3, 4, 5, 6, 7\], or run on at least 9 "
                r"ranks")
    fails("vision.layout.num_ranks", 8, "placement=non_colocated", "vision.layout.num_ranks=8",
          "llm.layout.tp=2", "llm.layout.pp=2",
          match=r"pp = 4\..*in \[1, 2, 3, 4\], or run on at least 12")


def test_an_island_overflow_offers_only_sizes_that_pass_every_rule():
    """4 ranks, vision's island set to 4: of the sizes leaving the LLM room (1, 2, 3), 1 and 3
    break the global batch's divisibility (32 over dp 3), so only 2 is offered; each offered
    value then passes."""
    from hcp.config.validate import validate

    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(["placement=non_colocated", "vision.layout.num_ranks=4"]), 4)
    assert e.value.field == "vision.layout.num_ranks" and e.value.candidates == [2], str(e.value)
    assert "use vision.layout.num_ranks in [2], or run on at least 5 ranks" in str(e.value)
    validate(compose_cfg(["placement=non_colocated", "vision.layout.num_ranks=2"]), 4)


def test_at_most_one_island_size_is_inferred():
    fails("vision.layout.num_ranks", 8, "mode=plan", "placement=non_colocated",
          "projector.layout.num_ranks=2", match="at most one")


def test_open_islands_fix_names_every_island_but_one_as_typed():
    two = cfg_of("placement=non_colocated", "mode=plan", recipe="llava_tiny_two_encoders")
    with pytest.raises(ConfigError) as err:
        check_layouts(two, 4)
    assert err.value.field == "vision.layout.num_ranks"
    assert str(err.value).endswith("Fix: set vision.layout.num_ranks and "
                                   "encoders.vision2.layout.num_ranks (or their dp)")
    two.vision.layout.num_ranks = two.encoders.vision2.layout.num_ranks = 1  # the fix works
    assert check_layouts(two, 4)["llm"].num_ranks == 2


def test_training_refuses_a_projector_island_before_the_size_rules():
    keys = ("placement=non_colocated", "vision.layout.num_ranks=1", "vision.layout.tp=1",
            "encoders.vision2.layout.num_ranks=1", "encoders.vision2.layout.tp=1")
    with pytest.raises(ConfigError, match="island of its own") as err:  # not "at most one"
        check_layouts(cfg_of(*keys, "projector.layout.rank_offset=1", recipe="llava_tiny_two_encoders"), 4)
    assert err.value.field == "projector.layout"
    assert "remove projector.layout.num_ranks, rank_offset and dp" in str(err.value)
    assert check_layouts(cfg_of(*keys, recipe="llava_tiny_two_encoders"), 4)["llm"].num_ranks == 2


def test_edges_must_name_present_modules():
    fails("graph.edges", 8, "vision=null", match="absent")


# ----------------------------------------------------------------------------- tensor parallel
def test_heads_divisible_by_tp():
    fails("llm.layout.tp", 8, "llm.layout.tp=8", match="llm.num_heads=4")
    fails("vision.layout.tp", 8, "vision.layout.tp=8", match="vision.num_heads=4")


def test_kv_heads_divisible_by_tp():
    fails("llm.layout.tp", 8, "llm.layout.tp=4", match="llm.num_kv_heads=2")


def test_ffn_divisible_by_tp():
    fails("llm.layout.tp", 8, "llm.layout.tp=4", "llm.num_kv_heads=4", "llm.ffn_hidden_size=390",
          match="llm.ffn_hidden_size=390")
    fails("vision.layout.tp", 8, "vision.layout.tp=4", "vision.ffn_hidden_size=258", match="ffn")


def test_vocab_divisible_by_tp_or_rejected_as_needing_padding():
    err = fails("llm.layout.tp", 8, "llm.layout.tp=2", "llm.vocab_size=263", match="llm.vocab_size=263")
    assert "padding" in str(err)


def test_projector_width_divisible_by_tp():
    fails("projector.layout.tp", 6, "launcher.nproc_per_node=6", "projector.layout.tp=3",
          match="llm.hidden_size=128")


# ----------------------------------------------------------------------------- pipeline
def test_layers_divisible_by_pp():
    err = fails("llm.layout.pp", 8, "llm.layout.pp=4", match="2 layers")
    assert "pp_layers" in str(err)


def test_pp_layers_must_sum_to_layers_with_one_entry_per_stage():
    fails("llm.layout.pp_layers", 8, "llm.layout.pp=2", "llm.layout.pp_layers=[1,2]", match="summing to 2")
    fails("llm.layout.pp_layers", 8, "llm.layout.pp=2", "llm.num_layers=3", "llm.layout.pp_layers=[3]",
          match="or set llm.layout.pp=1")
    fails("llm.layout.pp_layers", 8, "llm.layout.pp=2", "llm.layout.pp_layers=[2,0]")


# ----------------------------------------------------------------------------- tokens
def test_micro_batch_tokens_divisible_by_2cp():
    err = fails("trainer.micro_batch_tokens", 8, "llm.layout.cp=4", "trainer.micro_batch_tokens=4100",
                match="2\\*cp = 8")
    assert "padding" in str(err)


def test_micro_batch_tokens_divisible_by_tp_under_sequence_parallel():
    fails("trainer.micro_batch_tokens", 8, "llm.layout.tp=4", "llm.num_kv_heads=4",
          "llm.layout.sequence_parallel=true", "trainer.micro_batch_tokens=4098", match="sequence_parallel")
    check_layouts(cfg_of("llm.layout.tp=4", "llm.num_kv_heads=4", "trainer.micro_batch_tokens=4098"), 8)


# ----------------------------------------------------------------------------- lanes
def test_global_batch_divisible_by_every_dp():
    fails("trainer.global_batch_size", 8, "trainer.global_batch_size=12", match="dp=8")


def test_edge_dp_sizes_must_divide_one_another():
    fails("llm.layout.dp", 8, "placement=non_colocated", "vision.layout.num_ranks=3",
          "trainer.global_batch_size=15", match="neither divides")


# ----------------------------------------------------------------------------- dynamic CP
def test_dynamic_cp_pool_must_be_a_power_of_two():
    err = fails("llm.layout.cp", 6, *TEXT_ONLY, "launcher.nproc_per_node=6", "packing=dynamic_cp",
                "llm.layout.cp=3", "trainer.global_batch_size=2", "trainer.micro_batch_tokens=4098",
                match="power of two")
    assert "3*2 = 6" not in str(err) and "2*3 = 6" in str(err)
    check_layouts(cfg_of(*TEXT_ONLY, "launcher.nproc_per_node=6", "llm.layout.cp=3",
                         "trainer.global_batch_size=2", "trainer.micro_batch_tokens=4098"), 6)


# ----------------------------------------------------------------------------- choices
@pytest.mark.parametrize("key,value", [("llm.layout.cp_comm", "ring"), ("vision.layout.recompute", "some"),
                                       ("placement", "mixed"), ("packing", "best_fit")])
def test_unknown_choice_values(key, value):
    fails(key, 8, f"{key}={value}", match="unknown value")


def test_tp_fix_lists_only_values_that_pass_every_divisibility_rule():
    """tp=3 fails on num_heads=4 first; tp=4 would then fail on num_kv_heads=2, so it is not offered."""
    err = fails("llm.layout.tp", 12, "llm.layout.tp=3", match="llm.num_heads=4")
    assert "use llm.layout.tp in [1, 2]" in str(err), str(err)


def _validate_error(overrides, world):
    from hcp.config.validate import validate

    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(overrides), world, compose_cfg(overrides, resolve=False))
    return e.value


def test_a_fix_offers_only_values_that_pass_every_rule():
    """The issue's cases: tiny LLaVA tp=3 on 4 ranks offered 4, which then failed on
    num_kv_heads=2 (the encoders follow llm.layout.tp by interpolation and take the tried value
    too); llava_hetero on 64 ranks offered tp 16 for 40 heads."""
    e = _validate_error(["llm.layout.tp=3"], 4)
    assert e.field == "llm.layout.tp" and e.fix == "use llm.layout.tp in [1, 2]"
    e = _validate_error(["+recipe=llava_hetero", "llm.layout.tp=3"], 64)
    assert e.fix == "use llm.layout.tp in [1, 2, 4, 8]"
    e = _validate_error(["+recipe=llava_hetero", "llm.layout.tp=16"], 64)
    assert "llm.num_heads=40" in e.problem and e.fix == "use llm.layout.tp in [1, 2, 4, 8]"
    e = _validate_error(["llm.layout.pp=3"], 4)
    assert e.fix == "use llm.layout.pp in [1, 2]"


def test_a_fix_with_no_passing_value_says_so_and_names_the_rule_in_the_way():
    e = _validate_error(["+recipe=llama_tiny", "llm.layout.tp=3", "trainer.global_batch_size=1"], 4)
    assert e.fix.startswith("no single value of llm.layout.tp in [1, 2, 4] passes every rule")
    assert "trainer.global_batch_size=1: not divisible by llm's dp=4" in e.fix
