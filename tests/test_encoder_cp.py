"""Context parallelism inside the vision encoder (`vision.layout.cp`): the split of every input's
tokens over the encoder's CP group (`hcp.parallel.encoder_cp`), the ViT's bidirectional CP
attention against one process, and the step plan's routes from every source CP rank."""
import numpy as np
import pytest
import torch

from dist_utils import run_ranks
from hcp.parallel import encoder_cp


def test_split_known_values_and_balance():
    # 16 patches + CLS over 2 ranks: positions 0..8 and 9..17 (17 is padding)
    assert encoder_cp.positions(17, 2, 1).tolist() == list(range(9, 18))
    assert encoder_cp.output_range(16, 2, 0) == (1, 9) and encoder_cp.output_range(16, 2, 1) == (0, 8)
    assert encoder_cp.rows_on_rank(16, 4).tolist() == [4, 5, 5, 2]
    rank, local = encoder_cp.row_slot(np.arange(16), 16, 4)
    assert rank.tolist() == [0] * 4 + [1] * 5 + [2] * 5 + [3] * 2
    assert local.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    # every rank holds k positions of EVERY input: inputs of any count balance up to one chunk's padding
    for rows, cp in [(1024, 4), (256, 8), (16, 3), (5, 8)]:
        per = encoder_cp.rows_on_rank(rows, cp)
        assert per.sum() == rows and per.max() <= encoder_cp.chunk(rows + 1, cp)
        r, j = encoder_cp.row_slot(np.arange(rows), rows, cp)
        assert np.array_equal(np.bincount(r, minlength=cp), per)
        assert all(np.array_equal(j[r == q], np.arange(per[q])) for q in range(cp))


def _vit_cp(rank, world, tp):
    import torch.distributed as dist

    from cfg_utils import compose_cfg
    from hcp.model import ViTEncoder, init_parameters
    from hcp.model.collectives import group_size

    cfg = compose_cfg([]).vision
    cp = world // tp
    torch.set_default_dtype(torch.float64)  # exact math: fp32 noise of the sums is not the question
    groups = [dist.new_group([c * tp + t for t in range(tp)]) for c in range(cp)]   # tp groups
    cp_groups = [dist.new_group([c * tp + t for c in range(cp)]) for t in range(tp)]
    tp_group, cp_group = groups[rank // tp], cp_groups[rank % tp]
    torch.manual_seed(0)
    pixels = torch.randn(3, cfg.num_channels, cfg.image_size, cfg.image_size)
    grad_out = torch.randn(3, 16, cfg.hidden_size)
    ref = ViTEncoder(cfg)
    init_parameters(ref, 0, prefix="vision.")
    ref_out = ref(pixels)
    (ref_out * grad_out).sum().backward()
    vit = ViTEncoder(cfg, tp_group if tp > 1 else None, cp_group=cp_group)
    init_parameters(vit, 0, prefix="vision.")
    out = vit(pixels)
    r, j = encoder_cp.row_slot(np.arange(16), 16, cp)
    mine = torch.as_tensor(np.flatnonzero(r == rank // tp))
    torch.testing.assert_close(out, ref_out[:, mine], rtol=1e-10, atol=1e-12)
    (out * grad_out[:, mine]).sum().backward()
    for name, p in vit.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=cp_group)                       # partial over this rank's tokens
        spec = getattr(p, "shard_spec", None)
        want = ref.get_parameter(name).grad
        if spec is not None:
            want = want.chunk(group_size(tp_group), spec.dim)[rank % tp]
        torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    return float(sum(p.grad.pow(2).sum() for p in vit.parameters()))


@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2)])
def test_vit_cp_equals_one_process(world, tp):
    """cp2 and cp2 x tp2 (about 2 s): this rank's rows and, summed over CP, every gradient."""
    assert all(g > 0 for g in run_ranks(_vit_cp, world, tp, timeout=220))


ENCODER = ("vision.", "projector.")
COLOCATED = {  # 4 ranks: the LLM dp4 (tp from the case) under the encoder's cp x tp x dp
    "enc_cp2_tp2_dp_shard": ["vision.layout.cp=2", "vision.layout.tp=2", "vision.layout.dp_shard=true"],
    "enc_cp4__llm_tp2": ["vision.layout.cp=4", "vision.layout.tp=1", "llm.layout.tp=2"],
}
NON_COLOCATED = {  # encoder island first, then the LLM's tp2 island
    "enc_cp2__llm_tp2": (4, ["vision.layout.num_ranks=2", "vision.layout.cp=2"]),
    "enc_cp2_tp2__llm_tp2": (6, ["vision.layout.num_ranks=4", "vision.layout.cp=2", "vision.layout.tp=2"]),
}


def _assert_every_encoder_rank(results, reference, encoder_ranks):
    """Each encoder rank's own gradient before the sum is nonzero, and after it every rank holds
    the whole gradient of every encoder parameter, equal to one process's (rtol 1e-5)."""
    from parity_utils import assert_all_close
    from test_hetero_parity import TOL

    want = {k: v for k, v in reference["grads"].items() if k.startswith(ENCODER)}
    for r in encoder_ranks:
        assert results[r]["encoder_grad_sq"] > 0, f"encoder rank {r} got no gradient of its own"
        got = {k: v for k, v in results[r]["grads"].items() if k.startswith(ENCODER)}
        assert set(got) == set(want), f"rank {r}"
        assert_all_close(got, want, f"rank {r} grad", **TOL)


def _step_and_whole(rank, world, container, run_dir):
    """`test_hetero_parity._step`, then the encoder made whole for evaluation: it must encode a
    whole image on its own (no CP: evaluation re-encodes prompts' images on one rank)."""
    import hcp.train.trainer as trainer_module
    from test_hetero_parity import _step

    seen, forward_backward = [], trainer_module.Trainer.forward_backward
    trainer_module.Trainer.forward_backward = lambda tr, *a: seen.append(tr) or forward_backward(tr, *a)
    out = _step(rank, world, container, run_dir)
    with torch.no_grad():
        out["whole_rows"] = seen[0]._whole_encoder()(torch.zeros(2, 1, 8, 8)).shape[0]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from cfg_utils import compose_container
    from test_hetero_parity import SMALL, _step

    run = tmp_path_factory.mktemp("ref")
    return run_ranks(_step, 1, compose_container(SMALL, run), str(run), timeout=220)[0]


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", COLOCATED)
def test_colocated_encoder_cp_step_equals_single_process(name, reference, tmp_path):
    """About 15-30 s each (4 forked ranks): loss, counts, norm, every gradient and weight."""
    from cfg_utils import compose_container
    from parity_utils import assert_all_close, merged
    from test_hetero_parity import SMALL, TOL

    container = compose_container([*SMALL, *COLOCATED[name]], tmp_path)
    results = run_ranks(_step_and_whole, 4, container, str(tmp_path), timeout=220)
    for r in results:
        assert r["whole_rows"] == 2 * 16, "the evaluation encoder must return every row of an image"
        assert r["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert r["counts"] == reference["counts"]
        assert r["norm"] == pytest.approx(reference["norm"], rel=1e-5)
    _assert_every_encoder_rank(results, reference, range(4))
    assert_all_close(merged(results, "grads"), reference["grads"], "grad", **TOL)
    assert_all_close(merged(results, "weights"), reference["weights"], "weight", **TOL)


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", NON_COLOCATED)
def test_non_colocated_encoder_cp_step_equals_single_process(name, reference, tmp_path):
    """About 20-40 s each (4 or 6 forked ranks): as the colocated test, on islands; every
    encoder CP rank sends its own rows (each row crosses once)."""
    from cfg_utils import compose_container
    from parity_utils import assert_all_close, assert_island_ranks, merged
    from test_hetero_parity import SMALL, TOL
    from test_island_parity import _island_step

    world, extra = NON_COLOCATED[name]
    container = compose_container([*SMALL, "placement=non_colocated", "vision.layout.tp=1",
                                   "llm.layout.tp=2", *extra], tmp_path)
    results = run_ranks(_island_step, world, container, str(tmp_path), timeout=220)
    assert_island_ranks(results, reference)
    encoders = [r for r, res in enumerate(results) if res["encoder"]]
    assert len(encoders) == world - 2
    assert all(results[r]["route_bytes"][0] > 0 for r in encoders), "an encoder CP rank sent no row"
    _assert_every_encoder_rank(results, reference, encoders)
    assert_all_close(merged(results, "grads"), reference["grads"], "grad", **TOL)
    assert_all_close(merged(results, "weights"), reference["weights"], "weight", **TOL)


def test_plan_memory_charges_a_cp_rank_its_chunk_and_the_gathered_kv():
    """`hcp.preflight.memory` at full size (internvl_tiles_cp, encoder cp4 x dp32, 7 tiles of 1024
    patches per sample): a rank holds ceil(1025 / 4) = 257 tokens of each tile, and each ViT
    layer also keeps the all-gathered K/V (3 more chunks of 2h)."""
    from dataclasses import replace

    from cfg_utils import compose_cfg
    from hcp.config.layouts import check_layouts
    from hcp.config.precision import Precision
    from hcp.config.specs import resolve_modules
    from hcp.preflight.memory import _activations, encoder_activation_tokens, layer_bytes, weight_copy_bytes

    cfg = compose_cfg(["+recipe=internvl_tiles_cp", "vision.layout.recompute=none"], resolve=False)
    layouts = check_layouts(cfg, 128)
    specs = resolve_modules(cfg, layouts)
    vision = layouts["vision"]
    assert (vision.cp, vision.dp) == (4, 32)
    tokens, in_flight = encoder_activation_tokens(cfg, specs, vision, 0, layouts)
    assert (tokens, in_flight) == (32 / 32 * 7 * 257, 1)
    assert encoder_activation_tokens(cfg, specs, layouts["projector"], 0, layouts)[0] == 7 * 256
    h, prec = cfg.vision.hidden_size, Precision.of(cfg.precision)
    per_token = layer_bytes(h, h, cfg.vision.ffn_hidden_size, False, vision, prec)["none"]
    kept = tokens * (per_token + 3 * 2 * h * prec.act_bytes)
    # the recipe shards the encoder (FSDP): a block gathers its weights in bf16 and frees them
    # after its forward, so it keeps no autocast copy (the gathered units are charged as weights)
    assert vision.dp_shard
    assert _activations(cfg, specs, vision, 0, layouts) == pytest.approx(45 * kept)
    # unsharded, each block also keeps its matrices' bf16 copies for the backward
    copies = weight_copy_bytes(h, h, cfg.vision.ffn_hidden_size, vision, prec, gated=False)
    assert copies > 0 and _activations(cfg, specs, replace(vision, dp_shard=False), 0,
                                       layouts) == pytest.approx(45 * (kept + copies))


def test_digits_tiles_gives_each_scan_a_thumbnail_and_its_tiles(tmp_path):
    """The built-in tiled data (a few seconds: about 5,000 8x8 PNGs): every sample brings a
    thumbnail plus 1, 2 or 4 tiles, one `<image>` each, all grids drawn."""
    from collections import Counter

    from PIL import Image

    from hcp.data.digits import build_digits_tiles
    import json, os

    root = build_digits_tiles(str(tmp_path))
    records = json.load(open(os.path.join(root, "train.json")))
    counts = Counter(len(r["image"]) for r in records)
    assert set(counts) == {2, 3, 5} and counts[3] > counts[2]     # 1x2 and 2x1 both give 3
    for r in records[:50]:
        assert r["conversations"][0]["value"].count("<image>") == len(r["image"])
        assert all(Image.open(os.path.join(root, p)).size == (8, 8) for p in r["image"])
    assert build_digits_tiles(str(tmp_path)) == root                  # built once
