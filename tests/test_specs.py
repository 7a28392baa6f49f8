"""The module graph resolved once into typed specs (`hcp.config.specs`): what the layers read."""
import pytest

from cfg_utils import compose_cfg
from hcp.config.modules import Stream
from hcp.config.specs import resolve_modules
from hcp.config.validate import validate


def test_two_encoders_resolve_in_graph_order_with_their_layouts():
    cfg = compose_cfg(["+recipe=llava_tiny_two_encoders", "encoders.vision2.freeze=true",
                       "+encoders.vision2.optim={lr:1e-4}", "llm.layout.tp=2",
                       "encoders.vision2.layout.tp=1"])
    layouts = validate(cfg, 4)
    specs = resolve_modules(cfg, layouts)
    assert specs.names == ("vision", "vision2", "projector", "projector2", "llm")
    assert [m.kind for m in specs] == ["encoder", "encoder", "projector", "projector", "llm"]
    assert [m.key for m in specs] == ["vision", "encoders.vision2", "projector",
                                      "projectors.projector2", "llm"]
    assert specs.layouts == layouts and specs["vision2"].layout.tp == 1 and specs.llm.layout.tp == 2
    assert specs.streams == (Stream("projector", "vision"), Stream("projector2", "vision2"))
    assert [specs[p].source for p in ("projector", "projector2")] == ["vision", "vision2"]
    assert [specs.rows(s) for s in specs.streams] == [16, 4]  # 8x8 scans: 2x2 and 4x4 patches
    assert [m.name for m in specs if m.freeze] == ["vision2"]
    assert specs["vision2"].optim == {"lr": 1e-4} and specs["vision"].optim == {}
    assert specs["vision2"].hidden_size == cfg.encoders.vision2.hidden_size != specs["vision"].hidden_size
    assert specs["vision2"].arch is not None and specs["vision2"].arch.patch_size == 4
    assert specs.several_streams


def test_pooled_branch_resolves_its_pool_and_rows():
    cfg = compose_cfg(["+recipe=llava_tiny_two_encoders", "+projectors={pooled:{pool:2}}",
                       "graph.edges=[[vision,projector],[vision,pooled],[projector,llm],[pooled,llm],"
                       "[vision2,projector2],[projector2,llm]]"])
    specs = resolve_modules(cfg, validate(cfg, 4))
    assert specs["pooled"].pool == 2 and specs["pooled"].source == "vision"
    assert {s.projector: specs.rows(s) for s in specs.streams} == {"projector": 16, "pooled": 4, "projector2": 4}


def test_llama_tiny_is_one_llm_without_streams():
    cfg = compose_cfg(["+recipe=llama_tiny"])
    layouts = validate(cfg, 4)
    specs = resolve_modules(cfg, layouts)
    assert specs.names == ("llm",) and specs.llm.kind == "llm" and specs.llm.key == "llm"
    assert specs.layouts == layouts and specs.llm.layout.dp * specs.llm.layout.tp == 4
    assert specs.streams == () and not specs.several_streams and "vision" not in specs
    assert specs.of_kind("encoder") == () and specs.llm.hidden_size == cfg.llm.hidden_size


def test_without_layouts_and_unknown_module():
    specs = resolve_modules(compose_cfg([]))  # data preparation needs no layout
    assert specs.names == ("vision", "projector", "llm") and specs.llm.layout is None
    with pytest.raises(KeyError, match="vision2.*modules: \\['vision', 'projector', 'llm'\\]"):
        specs["vision2"]
