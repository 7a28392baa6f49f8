"""The recipes `+recipe=NAME` selects live in `recipes/` at the top of the tree (not in `conf/`)
and compose as Hydra config-group files would: defaults list, `# @package` header, overrides."""
import os

from cfg_utils import REPO, compose_cfg
from hcp.config.recipes import RECIPES_DIR, recipe_names, register_recipes


def test_the_recipes_are_the_files_of_recipes_and_conf_holds_no_recipe_group():
    assert RECIPES_DIR == os.path.join(REPO, "recipes")
    assert recipe_names() == sorted(f[:-5] for f in os.listdir(RECIPES_DIR) if f.endswith(".yaml"))
    assert {"llava_hetero", "llava_tiny_two_encoders", "llama_tiny"} <= set(recipe_names())
    assert not os.path.exists(os.path.join(REPO, "conf", "recipe"))


def test_a_recipe_keeps_its_defaults_list_its_global_package_and_yields_to_the_command_line():
    cfg = compose_cfg(["+recipe=llava_tiny_two_encoders", "encoders.vision2.layout.tp=1"])
    assert "vision2" in cfg.encoders and "projector2" in cfg.projectors  # its defaults list
    assert cfg.data.name == "digits_pair"
    assert cfg.encoders.vision2.layout.tp == 1  # the command line wins over the recipe
    assert compose_cfg(["+recipe=llama_tiny"]).vision is None  # `override /model: llama_tiny`


def test_a_recipe_registers_in_the_package_its_header_names_else_hydras_group_default(tmp_path):
    from hydra.core.config_store import ConfigStore

    (tmp_path / "hcp_test_global.yaml").write_text(
        "# @package _global_\ntrainer:\n  max_steps: 7\n")
    (tmp_path / "hcp_test_plain.yaml").write_text("max_steps: 7\n")
    register_recipes(str(tmp_path))
    node = ConfigStore.instance().load("recipe/hcp_test_global.yaml")
    assert node.package == "_global_" and node.node.trainer.max_steps == 7
    assert ConfigStore.instance().load("recipe/hcp_test_plain.yaml").package == "recipe"
