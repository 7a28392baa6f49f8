"""The encoder side under FSDP (`vision.layout.dp_shard`, `projector.layout.dp_shard`: FSDP2 over
the encoder's own DP group) through the trainer equals the single-process LLaVA (FP32): one
step's loss and counts, every module's gradients (made whole), the global gradient norm and the
weights after one AdamW step with per-module optimizer settings; rtol 1e-5 / atol 1e-6.

The data is LLaVA JSON whose encoder lanes hold samples with no, one or two images: one encoder
lane has no image at all (text-only samples) and the others different counts, so the lanes'
all-gathers and reduce-scatters must still line up (a hang fails the test by its timeout)."""
import json

import numpy as np
import pytest
import torch

from cfg_utils import compose_cfg, compose_container
from dist_utils import run_ranks
from parity_utils import merged
from test_hetero_parity import SMALL, TOL, _step

IMAGES_PER_POSITION = [0, 0, 1, 1, 2, 0, 1, 2]  # by position in global batch 0: lanes of 2 samples
OPTIM = ["optim.lr=1e-3", "optim.weight_decay=0.1", "vision.optim.lr=4e-4", "projector.optim.weight_decay=0.02"]


def _data(folder, seed: int) -> list[str]:
    """8 LLaVA records placed so that global batch 0 carries `IMAGES_PER_POSITION` images."""
    from PIL import Image

    from hcp.data.loader import GlobalBatchSampler

    folder.mkdir()
    rng = np.random.default_rng(0)
    order = GlobalBatchSampler(8, 8, seed).batch(0)
    records = [None] * 8
    for pos, index in enumerate(order):
        paths = []
        for k in range(IMAGES_PER_POSITION[pos]):
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8), "L").save(folder / f"{index}_{k}.png")
            paths.append(f"{index}_{k}.png")
        question = "<image>\n" * len(paths) + f"what is shown in picture {index}?"
        records[index] = {"id": f"r{index}", "image": paths or None,
                          "conversations": [{"from": "human", "value": question},
                                            {"from": "gpt", "value": f"answer {'ab' * (index + 1)}"}]}
    for r in records:
        if r["image"] is None:
            del r["image"]
    (folder / "data.json").write_text(json.dumps(records))
    return ["data=llava_json", f"data.path={folder / 'data.json'}", f"data.image_folder={folder}"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoder_fsdp")
    seed = compose_cfg(SMALL).seed
    overrides = [*SMALL, "trainer.micro_batch_tokens=320", *OPTIM, *_data(root / "data", seed)]
    return overrides, run_ranks(_step, 1, compose_container(overrides, root), str(root))[0]


CASES = {  # name: (overrides, the modules whose parameters are FSDP shards)
    "enc_dp4_dp_shard__llm_tp2_cp2": (["vision.layout.tp=1", "vision.layout.dp_shard=true",
                                       "llm.layout.tp=2", "llm.layout.cp=2"],  # the projector follows
                                      ["projector", "vision"]),
    # TP + FSDP in the encoder, a replicated projector next to a sharded vision encoder, encoder
    # recompute, and the LLM's own FSDP mesh on other ranks (its DP groups cross the encoder's)
    "enc_tp2_dp2_vision_dp_shard_recompute__llm_pp2_dp2_dp_shard": ([
        "vision.layout.tp=2", "vision.layout.dp_shard=true", "projector.layout.dp_shard=false",
        "vision.layout.recompute=full", "llm.layout.pp=2", "llm.layout.dp_shard=true"],
        ["llm", "vision"]),
}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", CASES)
def test_encoder_under_dp_shard_steps_like_one_process(name, base, tmp_path):
    overrides, ref = base
    assert ref["counts"][0] > 0 and ref["grads"]["vision.patch_embed.weight"].abs().sum() > 0
    layout, sharded = CASES[name]
    results = run_ranks(_step, 4, compose_container([*overrides, *layout], tmp_path), str(tmp_path),
                        timeout=220)
    grads, weights = merged(results, "grads"), merged(results, "weights")
    assert set(grads) == set(ref["grads"])
    for r in results:
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert r["counts"] == ref["counts"]
        assert r["sharded"] == sharded
        assert r["norm"] == pytest.approx(ref["norm"], rel=1e-5)
        assert r["groups"]["vision.decay"] == pytest.approx((4e-4, 0.1))
        assert r["groups"]["projector.decay"] == pytest.approx((1e-3, 0.02))
        assert r["groups"]["llm.no_decay"] == pytest.approx((1e-3, 0.0))
    for key, want in ref["grads"].items():
        torch.testing.assert_close(grads[key], want, **TOL, msg=lambda m, key=key: f"grad {key}: {m}")
    for key, want in ref["weights"].items():
        torch.testing.assert_close(weights[key], want, **TOL, msg=lambda m, key=key: f"weight {key}: {m}")
