"""`llm.init_from` / `mode=export`: transformers' own randomly initialised LlamaForCausalLM (saved
locally, no download) into hcp under tp2, pp2 and cp2 (logits within 1e-5 in FP32), checkpoint
checks before ranks start, and export back to a checkpoint transformers loads, bit for bit."""
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from cfg_utils import REPO, compose_cfg  # noqa: E402
from dist_utils import run_ranks  # noqa: E402
from hf_utils import hf_logits, save_llama, text_batch  # noqa: E402

from hcp.config.errors import ConfigError  # noqa: E402
from hcp.model import LlavaModel, init_parameters  # noqa: E402
from hcp.model.hf_load import apply_hf_configs, check_hf_weights, load_pretrained  # noqa: E402
from hcp.model.stage import StageSpec  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    model = save_llama(folder, shard_size="60KB")  # sharded, with model.safetensors.index.json
    return str(folder), model


def _cfg(folder, *extra):
    cfg = compose_cfg(["+recipe=llama_tiny", f"llm.init_from={folder}", "llm.attention_backend=torch",
                       *extra])
    apply_hf_configs(cfg, {e.split("=")[0] for e in extra})
    return cfg


def _fuse(src, dst):
    """The same weights with q/k/v fused into `qkv_proj` and gate/up into `gate_up_proj`."""
    from safetensors.torch import load_file, save_file

    sd = {}
    for f in glob.glob(os.path.join(src, "*.safetensors")):
        sd.update(load_file(f))
    for i in range(2):
        p = f"model.layers.{i}."
        sd[p + "self_attn.qkv_proj.weight"] = torch.cat([sd.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        sd[p + "mlp.gate_up_proj.weight"] = torch.cat([sd.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
    os.makedirs(dst, exist_ok=True)
    save_file(sd, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())
    return dst


def test_sharded_checkpoint_gives_transformers_logits_and_fused_qkv_the_same(llama_dir, tmp_path):
    folder, hf = llama_dir
    batch, docs = text_batch()
    ref = hf_logits(hf, docs)
    for src in (folder, _fuse(folder, str(tmp_path / "fused"))):
        cfg = _cfg(src)
        assert check_hf_weights(cfg) == []
        model = LlavaModel(None, None, cfg.llm)
        init_parameters(model, 0)
        load_pretrained(model, cfg)
        torch.testing.assert_close(model.logits(batch), ref, rtol=1e-5, atol=1e-5)
    assert (cfg.llm.hidden_size, cfg.llm.num_kv_heads, cfg.llm.ffn_hidden_size) == (64, 2, 128)


def _layout_logits(rank, world, folder, kind):
    import torch.distributed as dist

    cfg = _cfg(folder)
    group = dist.new_group([0, 1])
    stage = StageSpec.of([1, 1], rank) if kind == "pp" else None
    model = LlavaModel(None, None, cfg.llm, tp_group=group if kind == "tp" else None,
                       cp_group=group if kind == "cp" else None, stage=stage)
    init_parameters(model, 0)
    read = load_pretrained(model, cfg)["llm"]
    batch, _ = text_batch()
    if kind != "pp":
        return model.logits(batch).detach(), read
    if rank == 0:
        dist.send(model.stage_forward(batch).detach().contiguous(), 1)
        return None, read
    x = torch.empty(batch.input_ids.shape[0], cfg.llm.hidden_size)
    dist.recv(x, 0)
    return model.logits(batch, model.stage_forward(batch, x)).detach(), read


@pytest.mark.parametrize("kind", ["tp", "pp", "cp"])
def test_logits_equal_transformers_under_tp2_pp2_cp2_reading_only_own_slices(llama_dir, kind):
    folder, hf = llama_dir
    _, docs = text_batch()
    ref = hf_logits(hf, docs)
    out = run_ranks(_layout_logits, 2, folder, kind)
    logits = out[1][0]
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    if kind == "tp":
        torch.testing.assert_close(out[0][0], ref, rtol=1e-5, atol=1e-5)
    whole = sum(p.numel() * 4 for p in hf.parameters())
    if kind in ("tp", "pp"):  # each rank read about half of the bytes (norms are replicated)
        assert all(r < 0.6 * whole for _, r in out) and sum(r for _, r in out) >= whole
    else:
        assert all(r == whole for _, r in out)


def test_mismatch_lists_missing_wrong_shapes_and_unused(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = llama_dir
    sd = {}
    for f in glob.glob(os.path.join(folder, "*.safetensors")):
        sd.update(load_file(f))
    sd.pop("model.layers.1.mlp.up_proj.weight")
    sd["model.layers.0.mlp.down_proj.weight"] = sd["model.layers.0.mlp.down_proj.weight"][:, :64].contiguous()
    sd["model.extra.bias"] = torch.zeros(3)
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(sd, str(bad / "model.safetensors"))
    (bad / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    with pytest.raises(ConfigError) as e:
        check_hf_weights(_cfg(str(bad)))
    msg = str(e.value)
    assert "llm.layers.1.mlp.up_proj.weight <- model.layers.1.mlp.up_proj.weight" in msg
    assert "model.layers.0.mlp.down_proj.weight: stored [64, 64], llm.layers.0.mlp.down_proj.weight needs [64, 128]" in msg
    assert "1 unused tensors: model.extra.bias" in msg


def test_config_json_sets_architecture_and_a_conflicting_cli_value_names_both(llama_dir):
    folder, _ = llama_dir
    cfg = _cfg(folder, "llm.num_layers=2", "llm.rope_theta=10000.0")  # agreeing values are fine
    assert cfg.llm.num_layers == 2 and cfg.llm.vocab_size == 264
    with pytest.raises(ConfigError, match=r"llm.hidden_size=128: conflicts with hidden_size=64 from "):
        _cfg(folder, "llm.hidden_size=128")
    with pytest.raises(ConfigError, match="no config.json"):
        _cfg("/nonexistent")


def _train(args, timeout=300):
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "train.py", "logger=none", "trainer.progress_bar=false",
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["llm.layout.tp=2"], ["llm.layout.pp=2"]])
def test_import_then_export_is_bit_exact_and_transformers_reloads_it(llama_dir, tmp_path, layout):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    folder, hf = llama_dir
    out = tmp_path / "out"
    log = _train(["+recipe=llama_tiny", f"llm.init_from={folder}", "mode=export", f"export.dir={out}",
                  "launcher.nproc_per_node=2", *layout, f"hydra.run.dir={tmp_path / 'run'}"])
    assert "exported" in log
    src, dst = {}, {}
    for f in glob.glob(os.path.join(folder, "*.safetensors")):
        src.update(load_file(f))
    for f in glob.glob(str(out / "llm" / "*.safetensors")):
        dst.update(load_file(f))
    assert sorted(src) == sorted(dst)
    assert all(torch.equal(src[k], dst[k]) and src[k].dtype == dst[k].dtype for k in src)
    if "pp" in layout[0]:  # one shard per stage, with transformers' index
        index = json.load(open(out / "llm" / "model.safetensors.index.json"))
        assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors",
                                                     "model-00002-of-00002.safetensors"}
    reloaded = LlamaForCausalLM.from_pretrained(str(out / "llm")).eval()
    _, docs = text_batch()
    torch.testing.assert_close(hf_logits(reloaded, docs), hf_logits(hf, docs), rtol=0, atol=0)
