"""`vision.init_from` with `vision.arch=clip`: transformers' randomly initialised CLIPVisionModel
(saved locally) gives the same hidden states at `select_layer`; LLaVA stage 1 from imported
LLaMA + CLIP weights trains only the projector; export writes CLIPVisionModel + mm_projector."""
import glob
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from cfg_utils import REPO, compose_cfg  # noqa: E402
from dist_utils import run_ranks  # noqa: E402
from hf_utils import save_clip, save_llama  # noqa: E402

from hcp.config.errors import ConfigError  # noqa: E402
from hcp.model import LlavaModel, init_parameters  # noqa: E402
from hcp.model.encoder_types import build_encoder  # noqa: E402
from hcp.model.hf_load import apply_hf_configs, check_hf_weights, load_pretrained  # noqa: E402


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip")
    return str(folder), save_clip(folder)


def _cfg(folder, *extra):
    cfg = compose_cfg([f"vision.init_from={folder}", *extra])
    apply_hf_configs(cfg, set())
    return cfg


@torch.no_grad()
def _hf_states(hf, pixels, select_layer):
    return hf(pixel_values=pixels, output_hidden_states=True).hidden_states[select_layer][:, 1:]


@pytest.mark.parametrize("select_layer", [-1, -2])
def test_hidden_states_at_select_layer_equal_transformers(clip_dir, select_layer):
    folder, hf = clip_dir
    cfg = _cfg(folder, f"vision.select_layer={select_layer}")
    assert (cfg.vision.arch, cfg.vision.num_channels, cfg.vision.num_layers) == ("clip", 3, 3)
    lines = check_hf_weights(cfg)
    assert lines[0].startswith(f"vision.init_from: not loaded by design ({2 if select_layer == -1 else 18} "
                               "tensors): ") and "(after select_layer)" in lines[0]
    model = LlavaModel(cfg.vision, cfg.projector, cfg.llm)
    init_parameters(model, 0)
    load_pretrained(model, cfg)
    pixels = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.vision(pixels), _hf_states(hf, pixels, select_layer),
                               rtol=1e-5, atol=1e-5)
    cfg.vision.arch = "vit"  # the tiny default's GELU is not CLIP's quick-GELU: it differs
    vit = build_encoder(cfg.vision)
    vit.load_state_dict(model.vision.state_dict())
    assert not torch.allclose(vit(pixels), model.vision(pixels), atol=1e-4)


def _vision_under(rank, world, folder, kind):
    import torch.distributed as dist

    from hcp.model.stage import StageSpec

    from hcp.model.llava import LlavaEncoder

    cfg = _cfg(folder, "vision.select_layer=-2")
    group = dist.new_group([0, 1])
    if kind == "tp":  # the encoder's own TP: heads and MLP columns split, each rank reads its slices
        model = LlavaEncoder(cfg.vision, cfg.projector, cfg.llm.hidden_size, tp_group=group)
    else:
        model = LlavaModel(cfg.vision, cfg.projector, cfg.llm, cp_group=group if kind == "cp" else None,
                           stage=StageSpec.of([1, 1], rank) if kind == "pp" else None)
    init_parameters(model, 0)
    read = load_pretrained(model, cfg).get("vision")
    if model.vision is None:
        return None, read
    pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    return model.vision(pixels).detach(), read


@pytest.mark.parametrize("kind", ["tp", "pp", "cp"])
def test_hidden_states_equal_transformers_under_tp2_pp2_cp2(clip_dir, kind):
    folder, hf = clip_dir
    ref = _hf_states(hf, torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)), -2)
    out = run_ranks(_vision_under, 2, folder, kind)
    for states, _ in out if kind != "pp" else out[:1]:  # under pp the encoder is on the first stage
        torch.testing.assert_close(states, ref, rtol=1e-5, atol=1e-5)
    if kind == "tp":
        whole = sum(p.numel() * 4 for n, p in hf.named_parameters() if "layers.2" not in n and "post" not in n)
        assert all(r < 0.6 * whole for _, r in out) and sum(r for _, r in out) > whole


def test_clip_model_text_tower_is_listed_and_a_mismatch_is_an_error(clip_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = clip_dir
    sd = load_file(os.path.join(folder, "model.safetensors"))
    full = {f"vision_model.{k}": v for k, v in sd.items()}  # a CLIPModel's names
    full.update({"text_model.embeddings.token_embedding.weight": torch.zeros(4, 4),
                 "logit_scale": torch.zeros(()), "visual_projection.weight": torch.zeros(4, 64)})
    (tmp_path / "full").mkdir()
    save_file(full, str(tmp_path / "full" / "model.safetensors"))
    (tmp_path / "full" / "config.json").write_text(
        '{"model_type": "clip", "vision_config": ' + open(os.path.join(folder, "config.json")).read() + "}")
    lines = check_hf_weights(_cfg(str(tmp_path / "full"), "vision.select_layer=-2"))
    assert "logit_scale (CLIP text side)" in lines[0] and "text_model." in lines[0]
    full["vision_model.extra.weight"] = torch.zeros(2)
    full.pop("vision_model.encoder.layers.0.mlp.fc1.bias")
    save_file(full, str(tmp_path / "full" / "model.safetensors"))
    with pytest.raises(ConfigError) as e:
        check_hf_weights(_cfg(str(tmp_path / "full")))
    assert "vision.blocks.0.fc1.bias <- vision_model.encoder.layers.0.mlp.fc1.bias" in str(e.value)
    assert "1 unused tensors: vision_model.extra.weight" in str(e.value)


def _train(args):
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "train.py", "logger=none", "trainer.progress_bar=false",
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in glob.glob(os.path.join(folder, "*.safetensors")):
        out.update(load_file(f))
    return {k.removeprefix("vision_model."): v for k, v in out.items()}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stage1_from_imported_llama_and_clip_trains_only_the_projector_and_exports(clip_dir, tmp_path):
    from transformers import CLIPVisionModel

    folder, hf = clip_dir
    llama = tmp_path / "llama"
    save_llama(llama)
    run = tmp_path / "stage1"
    common = [f"llm.init_from={llama}", f"vision.init_from={folder}", "vision.select_layer=-2",
              "+stage=pretrain", "launcher.nproc_per_node=2", "llm.layout.tp=2",
              f"checkpoint.dir={run}/checkpoints"]
    _train([*common, "trainer.max_steps=3", "trainer.global_batch_size=8", "trainer.eval_every=0",
            "trainer.eval_samples=8", "trainer.micro_batch_tokens=256", f"hydra.run.dir={run}"])
    out = tmp_path / "export"
    log = _train([*common, "mode=export", f"export.dir={out}", "resume=auto", f"hydra.run.dir={tmp_path / 'x'}"])
    assert "model weights of step 3" in log
    for src, dst in ((llama, out / "llm"), (folder, out / "vision")):  # unchanged, bit for bit
        a, b = _tensors(src), _tensors(dst)
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), dst
    proj = torch.load(out / "mm_projector.bin")
    assert sorted(proj) == ["model.mm_projector.0.bias", "model.mm_projector.0.weight",
                            "model.mm_projector.2.bias", "model.mm_projector.2.weight"]
    assert proj["model.mm_projector.0.weight"].shape == (64, 64)
    init = compose_cfg(["vision.hidden_size=64", "llm.hidden_size=64"])
    fresh = LlavaModel(init.vision, init.projector, init.llm)
    init_parameters(fresh, init.seed)
    assert not torch.equal(proj["model.mm_projector.2.weight"], fresh.projector.fc2.weight)  # trained
    reloaded = CLIPVisionModel.from_pretrained(str(out / "vision")).eval()
    pixels = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(_hf_states(reloaded, pixels, -2), _hf_states(hf, pixels, -2), rtol=0, atol=0)


def test_clip_images_are_preprocessed_as_llava_15_pads_and_clip_normalizes(tmp_path):
    import numpy as np
    import transformers
    from PIL import Image

    from hcp.data.clip_image import MEAN, load_clip_image

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (30, 50, 3), dtype=np.uint8)).save(tmp_path / "x.png")
    im = Image.open(tmp_path / "x.png").convert("RGB")
    square = Image.new("RGB", (50, 50), tuple(int(m * 255) for m in MEAN))  # LLaVA's expand2square
    square.paste(im, (0, 10))
    processor = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    ref = processor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})(
        images=square, return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(load_clip_image(str(tmp_path / "x.png"), 16), ref, rtol=0, atol=1e-6)
