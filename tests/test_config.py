"""Config composition and validation: errors name the field, the value and a fix, before any
rank starts."""
import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from cfg_utils import compose_cfg
from hcp.config.errors import ConfigError
from hcp.config.validate import validate
from hcp.config.specs import resolve_modules
from cfg_utils import resume_check, with_specs


def test_base_config_is_the_tiny_llava_on_digits_and_validates():
    cfg = compose_cfg()
    assert cfg.data.name == "digits_vqa" and cfg.vision.image_size == 8 and cfg.llm.num_layers == 2
    validate(cfg, world_size=4)


def test_recipe_llava_tiny_names_the_same_run():
    assert compose_cfg(["+recipe=llava_tiny"]) == compose_cfg()


@pytest.mark.parametrize("override, closest", [
    ("trainer.max_step=10", "trainer.max_steps"), ("+trainer.max_step=10", "trainer.max_steps"),
    ("llm.hiden_size=8", "llm.hidden_size"), ("++llm.layout.tpp=2", "llm.layout.tp"),
    ("+optim.weightdecay=0.1", "optim.weight_decay")])
def test_misspelled_key_fails_naming_the_closest_key_with_or_without_plus(override, closest):
    with pytest.raises(ConfigError) as e:
        compose_cfg([override])
    assert e.value.field == override.lstrip("+").split("=")[0] and f"`{closest}`" in str(e.value)


def test_a_key_added_past_the_schema_fails_validation():
    from omegaconf import OmegaConf

    cfg = compose_cfg()
    OmegaConf.update(cfg, "trainer.max_step", 10, force_add=True)  # what Hydra's `+` does
    with pytest.raises(ConfigError, match="did you mean `trainer.max_steps`"):
        validate(cfg, world_size=4)


def test_group_choices_and_hydra_keys_are_not_schema_keys():
    from hcp.config.compose import config_groups
    from hcp.config.keys import check_overrides

    check_overrides(["data=llava_json", "+recipe=llama_tiny", "hydra.run.dir=/x", "hydra/launcher=basic",
                     "~vision", "llm.layout.pp_layers=[1,1]", "optim.lr=1e-3,3e-3"], config_groups())


@pytest.mark.parametrize("override, message", [
    ("trainer.max_steps=abc", "trainer.max_steps='abc': expects an integer"),
    ("optim.lr=fast", "optim.lr='fast': expects a number"),
    ("+recipe=llava_tin", "recipe='llava_tin': no such recipe (recipes/llava_tin.yaml). "
                          "Fix: did you mean `+recipe=llava_tiny`?"),  # with the `+` it needs
    ("+recipe=llava_hetro", "recipe='llava_hetro': no such recipe (recipes/llava_hetro.yaml). "
                            "Fix: did you mean `+recipe=llava_hetero`?"),
    ("data=digits", "data='digits': no such data (conf/data/digits.yaml). Fix: did you mean "
                    "`data=digits_vqa`?"),
    ("data=nope", "data='nope': no such data"),
])
def test_a_wrong_value_type_or_group_option_is_one_config_error_before_hydra(override, message):
    from hcp.config.compose import CONF_DIR, config_groups
    from hcp.config.keys import check_overrides

    with pytest.raises(ConfigError) as err:
        check_overrides([override], config_groups(), CONF_DIR)
    assert str(err.value).startswith(message)
    check_overrides(["trainer.max_steps=3,4", "optim.lr=${oc.env:LR}", "resume=null",
                     "+recipe=llava_tiny", "llm.init_from=null"], config_groups(), CONF_DIR)


def test_removed_keys_nothing_reads_are_unknown():
    for override in ("vision.offload=true", "launcher.name=slurm"):
        with pytest.raises(ConfigError):
            compose_cfg([override])


@pytest.mark.parametrize("override, message", [
    ("llm.layout=[2,2]", "llm.layout=[2, 2]: expects a mapping of LayoutConfig's keys (tp, cp, "),
    ("llm.layout={tp:x}", "llm.layout.tp='x': expects an integer. Fix: give llm.layout.tp an integer"),
    ("llm.layout.pp_layers=3", "llm.layout.pp_layers=3: expects a list of integers or null. "
                               "Fix: give llm.layout.pp_layers a list of integers or null, e.g. "),
    ("llm.layout.dp_shard=maybe", "llm.layout.dp_shard='maybe': expects true or false"),
    ("graph.edges=5", "graph.edges=5: expects a list of lists of strings"),
    ("+encoders={v2:{layout:{tp:x}}}", "encoders.v2.layout.tp='x': expects an integer"),
    ("trainer.max_steps=1.5", "trainer.max_steps=1.5: expects an integer"),
])
def test_a_wrong_type_anywhere_is_one_config_error_naming_the_field(override, message):
    """Not Hydra's "Cannot merge DictConfig with ListConfig" block: the field, the value, the
    type it takes and how to give one."""
    from hcp.config.compose import CONF_DIR, config_groups
    from hcp.config.keys import check_overrides

    with pytest.raises(ConfigError) as err:
        check_overrides([override], config_groups(), CONF_DIR)
    assert str(err.value).startswith(message)
    check_overrides(["llm.layout={tp:2,cp:2}", "+projectors={projector2:{}}", "llm.layout.pp_layers=[1,1]",
                     "llm.layout.pp_layers=null", "graph.edges=[[vision,projector],[projector,llm]]"],
                    config_groups(), CONF_DIR)


def test_wrong_type_fails():
    with pytest.raises(ConfigError, match="trainer.max_steps='many': expects an integer"):
        compose_cfg(["trainer.max_steps=many"])
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:  # Hydra's own check
        compose_cfg(["trainer.max_steps=${oc.env:HCP_NO_SUCH_VARIABLE,many}"])
    assert "max_steps" in str(e.value) + str(e.value.__cause__)


@pytest.mark.parametrize("overrides, field", [
    (["placement=everywhere"], "placement"),
    (["precision=fp8"], "precision"),
    (["llm.attention_backend=te"], "llm.attention_backend"),
    (["llm.attention_backend=flash"], "llm.attention_backend"),
    (["trainer.micro_batch_tokens=64"], "trainer.micro_batch_tokens"),
    (["trainer.global_batch_size=30"], "trainer.global_batch_size"),
    (["vision.patch_size=3"], "vision.patch_size"),
    (["optim.lr=0"], "optim.lr"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay"),
    (["vision.layout.pp=2"], "vision.layout.pp"),
    (["vision.optim.lr=-1"], "vision.optim.lr"),
    (["projector.optim.weight_decay=-0.1"], "projector.optim.weight_decay"),
    (["data.on_error=ignore"], "data.on_error"),
    (["graph.edges=[[vision,decoder]]"], "graph.edges"),
    (["optim.name=sgd"], "optim.name"),
    (["projector.type=mlp3x_gelu"], "projector.type"),
    (["llm.attention_backend=te", "llm.layout.cp=2"], "llm.attention_backend"),
    (["llm.attention_backend=flash", "llm.layout.cp=2"], "llm.attention_backend"),
    (["data.eval_fraction=1.5"], "data.eval_fraction"),
    (["data.max_seq_len=0"], "data.max_seq_len"),
    (["trainer.save_every=-2"], "trainer.save_every"),
    (["optim.warmup_ratio=2"], "optim.warmup_ratio"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip"),
    (["data.images_per_sample=-1"], "data.images_per_sample"),
])
def test_validation_names_field_value_and_fix(overrides, field):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(overrides), world_size=4)
    assert e.value.field == field and "Fix:" in str(e.value)


def test_backend_without_cp_is_rejected_before_the_install_check():
    with pytest.raises(ConfigError, match="context parallelism"):
        validate(compose_cfg(["llm.attention_backend=flash", "llm.layout.cp=2"]), world_size=4)


def test_te_with_cp_is_refused_when_transformer_engine_is_missing():
    """te runs CP on Transformer Engine's THD CP, which is not installed here."""
    with pytest.raises(ConfigError, match="transformer_engine"):
        validate(compose_cfg(["llm.attention_backend=te", "llm.layout.cp=2"]), world_size=4)


def test_backend_names_and_cp_strategies_are_defined_once():
    from hcp.config import choices, layouts
    from hcp.model import backends, cp_attention

    assert backends.BACKENDS is choices.ATTENTION_BACKENDS and backends._MODULES is choices.BACKEND_MODULES
    assert cp_attention.CP_COMMS is layouts.CP_COMMS


def test_missing_gpu_backend_says_how_to_install():
    with pytest.raises(ConfigError, match="transformer_engine"):
        validate(compose_cfg(["llm.attention_backend=te"]), world_size=4)


@pytest.mark.parametrize("overrides, field", [
    (["vision.layout.cp=2", "projector.pool=2"], "projector.pool"),   # its windows span the CP chunks
    (["llm.layout.pp=2", "llm.tie_embeddings=true"], "llm.tie_embeddings"),
    (["vision.layout.pp=2"], "vision.layout.pp"),   # encoder PP comes with placement=non_colocated
])
def test_training_rejects_layouts_it_cannot_run_yet_with_a_fix(overrides, field):
    from hcp.train.support import check_trainable

    cfg = compose_cfg(overrides)
    with pytest.raises(ConfigError) as e:
        check_trainable(cfg, resolve_modules(cfg, validate(cfg, world_size=4)))
    assert e.value.field == field and "Fix:" in str(e.value)


def test_vocab_smaller_than_the_tokenizer_is_rejected_before_ranks_start():
    from hcp.data.build import prepare_data

    with pytest.raises(ConfigError) as e:
        prepare_data(*with_specs(compose_cfg(["llm.vocab_size=100"])))
    assert e.value.field == "llm.vocab_size" and "260" in str(e.value)


def test_encoder_side_follows_the_llm_tp_by_default_and_trains_its_own_layout():
    from hcp.train.support import check_trainable

    cfg = compose_cfg(["llm.layout.tp=2", "llm.layout.cp=2"])
    assert (cfg.vision.layout.tp, cfg.projector.layout.tp, cfg.vision.layout.cp) == (2, 2, 1)
    layouts = validate(cfg, world_size=4)
    assert (layouts["vision"].dp, layouts["projector"].dp, layouts["llm"].dp) == (2, 2, 1)
    check_trainable(cfg, resolve_modules(cfg, layouts))
    cfg = compose_cfg(["llm.layout.tp=2", "vision.layout.tp=1"])      # encoder dp4, LLM tp2 dp2
    check_trainable(cfg, resolve_modules(cfg, validate(cfg, world_size=4)))


def test_a_projector_layout_apart_from_its_encoder_names_both_and_a_fix():
    cfg = compose_cfg(["vision.layout.tp=1", "projector.layout.tp=2", "projector.layout.dp=-1"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=4)
    assert e.value.field == "projector.layout" and "vision.layout tp1" in str(e.value)
    assert "projector.layout tp2" in str(e.value) and "Fix: give it vision's layout" in str(e.value)


def test_every_module_frozen_is_rejected():
    cfg = compose_cfg(["vision.freeze=true", "projector.freeze=true", "llm.freeze=true"])
    with pytest.raises(ConfigError, match="nothing would train"):
        validate(cfg, world_size=4)


def test_launch_inputs_are_checked_before_ranks_start(tmp_path):
    from hcp.data.build import prepare_data
    from hcp.launch.launch import local_world_size, resolve_nproc

    with pytest.raises(ConfigError, match="launcher.nnodes=2"):
        local_world_size(compose_cfg(["launcher.nnodes=2", "launcher.nproc_per_node=2"]), None)
    assert local_world_size(compose_cfg(["launcher.nnodes=2"]), {"world_size": 8}) == 8
    with pytest.raises(ConfigError, match="launcher.nproc_per_node='abc'"):
        resolve_nproc("abc")
    with pytest.raises(ConfigError, match="resume="):
        resume_check(compose_cfg([f"resume={tmp_path}/nope"]))
    with pytest.raises(ConfigError, match="data.path"):
        prepare_data(*with_specs(compose_cfg(["data=llava_json"])))
    with pytest.raises(ConfigError, match=r"data.path='/nope.json': no such file\. Fix"):
        prepare_data(*with_specs(compose_cfg(["data=llava_json", "data.path=/nope.json"])))
    with pytest.raises(ConfigError, match="exceeds the 1527 training samples"):
        prepare_data(*with_specs(compose_cfg(["trainer.global_batch_size=2000"])))


def test_a_key_below_a_plain_value_names_the_closest_key():
    """`packing.profile=PATH`: `packing` is a choice, not a section; Hydra's message was
    `Cannot convert 'dict' to string`."""
    from hcp.config.keys import check_overrides

    with pytest.raises(ConfigError) as e:
        check_overrides(["packing.profile=/tmp/x.yaml"], set())
    assert e.value.field == "packing.profile" and "did you mean `packing_profile`?" in str(e.value)


def test_a_misspelt_wandb_mode_fails_before_the_run_not_as_a_warning_after():
    """wandb.init(mode="offlne") fails inside the run, which then trains unlogged: refused
    up front; without wandb the key is not read."""
    from cfg_utils import compose_cfg
    from hcp.config.validate import check_choices

    with pytest.raises(ConfigError, match=r"logger.mode='offlne': unknown value. Fix: use one of "
                                          r"offline, online"):
        check_choices(compose_cfg(["logger=wandb", "logger.mode=offlne"]))
    check_choices(compose_cfg(["logger=none", "logger.mode=offlne"]))
