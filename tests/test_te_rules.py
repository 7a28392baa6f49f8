"""`llm.attention_backend=te` against the installed Transformer Engine (hcp.config.te_rules):
THD CP with all-gather needs TE >= 2.18, fp32 is refused, and hcp's THD CP call passes
`pad_between_seqs=True` (TE <= 2.17 would otherwise compare device tensors with torch.equal).
TE is not installed here: its version and module are faked."""
import sys
import types
from importlib import metadata

import pytest
import torch

import hcp.config.te_rules as te_rules
from hcp.config.errors import ConfigError


@pytest.fixture
def te_installed(monkeypatch):
    """Validation sees an installed TE of the version the test sets in `version[0]`."""
    import hcp.config.validate as validate

    version = [(2, 17, 1)]
    real = validate.importlib.util.find_spec
    monkeypatch.setattr(validate.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real(name, *a))
    monkeypatch.setattr(te_rules, "te_version", lambda: version[0])
    return version


def _validate(*overrides, world=2):
    from cfg_utils import compose_cfg
    from hcp.config.validate import validate

    return validate(compose_cfg(["+recipe=llama_tiny", "llm.attention_backend=te", *overrides]), world)


def test_te_allgather_cp_on_te_2_17_is_refused_before_any_rank_starts(te_installed):
    with pytest.raises(ConfigError, match="Transformer Engine 2.17.1 .* from 2.18") as e:
        _validate("precision=bf16", "llm.layout.cp=2")
    assert e.value.field == "llm.layout.cp_comm" and "cp_comm=p2p" in e.value.fix
    with pytest.raises(ConfigError, match="llm.layout.cp_comm"):  # dynamic CP: the pool of 2
        _validate("precision=bf16", "packing=dynamic_cp")
    _validate("precision=bf16", "llm.layout.cp=2", "llm.layout.cp_comm=p2p")  # the ring runs
    _validate("precision=bf16", "llm.layout.dp=2")                           # no CP: no rule
    te_installed[0] = (2, 18)
    _validate("precision=bf16", "llm.layout.cp=2")


def test_te_with_fp32_is_refused(te_installed):
    with pytest.raises(ConfigError, match="fp16/bf16") as e:
        _validate("precision=fp32", "llm.layout.dp=2")
    assert e.value.field == "precision" and "precision=bf16" in e.value.fix


def test_te_version_reads_the_distribution(monkeypatch):
    monkeypatch.setattr(metadata, "version", lambda name: "2.18.0.dev0+abc")
    assert te_rules.te_version() >= te_rules.TE_THD_ALLGATHER   # a 2.18 pre-release counts
    te_rules.check_te_cp("allgather")

    def missing(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "version", missing)
    assert te_rules.te_version() is None


def test_te_thd_cp_call_passes_pad_between_seqs_and_checks_the_version(monkeypatch):
    """hcp's TE CP attention (hcp.model.te_cp) on a fake TE module: every call passes
    `pad_between_seqs=True` with the padded boundaries; TE 2.17 with allgather is refused."""
    import hcp.model.te_cp as te_cp

    calls = []

    class DotProductAttention:
        def __init__(self, *args, **kwargs):
            self.kwargs = kwargs

        def set_context_parallel_group(self, group, ranks, stream, comm_type):
            self.comm_type = comm_type

        def __call__(self, q, k, v, **kwargs):
            calls.append((self.comm_type, kwargs))
            return q

    fake = types.ModuleType("transformer_engine.pytorch")
    fake.DotProductAttention = DotProductAttention
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", fake)
    monkeypatch.setattr(te_cp.torch.cuda, "Stream", lambda device: object())
    monkeypatch.setattr(te_cp.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(te_cp.dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(te_rules, "te_version", lambda: (2, 17, 1))
    with pytest.raises(ConfigError, match="llm.layout.cp_comm"):
        te_cp.te_cp_attention("allgather")
    q = torch.zeros(4, 2, 8)
    te_cp.te_cp_attention("p2p")(torch.tensor([0, 5, 8]), object(), "cpu")(q, q, q)
    assert calls[-1][0] == "p2p" and calls[-1][1]["pad_between_seqs"] is True
    assert calls[-1][1]["cu_seqlens_q_padded"].tolist() == [0, 8, 12]  # documents padded to 2c
    monkeypatch.setattr(te_rules, "te_version", lambda: (2, 18, 0))
    te_cp.te_cp_attention("allgather")(torch.tensor([0, 5, 8]), object(), "cpu")(q, q, q)
    assert calls[-1][0] == "all_gather" and calls[-1][1]["pad_between_seqs"] is True
