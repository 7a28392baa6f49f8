"""The encoder island's cost model and floor of benchmarks/dcp_islands.py (issue 25 section 3):
per rank of a vision island, the work of one step plan (`encoder_work`) and the unit costs
measured on this machine (`FloorRound`, `floor_units`), combined into a modelled time and a
floor (`encoder_times`).

The floor's unit costs are measured by the run's own 8 rank processes between its timed steps
(a `FloorRound` after each step), apart from the step's code: no schedule, no route, no
waiting. So they see what the step sees on this shared machine (the 8 ranks on its cores and
whatever else loads it at that minute: a rank's CPU time per FLOP or per call rises with it),
and never the step's own time. Each round: every rank runs the ViT and its projector forward +
backward at several image counts (their FLOPs and layer calls) and, in groups of the CP size,
one block's CP attention (its K/V all-gather and reduce-scatter); then the island's ranks sum
the island's gradients (one all-reduce over its 4 ranks, which DP and CP layouts alike pay).
Each unit cost takes every rank's least round (a floor) and the median over the ranks."""
from __future__ import annotations

import time

import numpy as np


def encoder_work(cfg, vis, plan) -> np.ndarray:
    """float [vision ranks, 4] of one step plan: per rank of the vision island (layout `vis`),
    its training FLOPs and the K/V bytes it receives forward and backward (its lane's images,
    each at hcp's terms, `hcp.preflight.auto_encoders.encoder_cp_share`, fp32), its layer calls
    (blocks + patch embedding + projector per micro-batch with images) and its CP attention
    calls (one per block and such micro-batch)."""
    from hcp.model.flops import encoder_flops
    from hcp.parallel import encoder_cp
    from hcp.preflight.auto_encoders import encoder_cp_share

    v = cfg.vision
    blocks = v.num_layers + v.select_layer + 1
    tokens = (v.image_size // v.patch_size) ** 2 + encoder_cp.LEAD
    per_image, kv_pass = encoder_cp_share(encoder_flops(v, cfg.llm.hidden_size, 1.0), tokens, blocks,
                                          v.hidden_size, vis.cp)
    kv_bytes = 2 * kv_pass
    out = []
    for r in vis.ranks:
        images = np.asarray(plan.rank(r).encoder_inputs["vision"], dtype=np.float64)
        busy = float((images > 0).sum())
        out.append([images.sum() * per_image, images.sum() * kv_bytes, busy * (blocks + 2),
                    busy * blocks * (vis.cp > 1)])
    return np.array(out)


ENCODER_IMAGES = (1, 3, 6)
"""Images per ViT + projector pass of a floor round (the micro-batches' range per lane)."""
KV_IMAGES = (4, 16, 64)
"""Images per CP attention call of a floor round."""


class FloorRound:
    """The floor's workloads on one rank of a run, timed once per call between the run's steps
    (module docstring); every rank of the world builds one (it creates process groups).

    `cfg`: the run's config; `cp`: its encoder CP size; `island`: the vision island's ranks."""

    def __init__(self, cfg, cp: int, island: list[int]):
        import torch
        import torch.distributed as dist
        from omegaconf import OmegaConf

        from hcp.model.encoder_types import build_encoder
        from hcp.model.projector import Projector
        from hcp.model.vit import ViTEncoder

        v, rank, world = cfg.vision, dist.get_rank(), dist.get_world_size()
        sync_group = dist.new_group(island)
        kv_groups = [dist.new_group(list(range(g, g + cp))) for g in range(0, world, cp)] if cp > 1 else []
        self.sync = None
        if rank in island:
            params = [torch.zeros(s, requires_grad=True) for s in island_grad_shapes(cfg)]
            for p in params:
                p.grad = torch.randn(p.shape)
            self.sync = (params, sync_group)
        enc, proj = build_encoder(v), Projector(cfg.projector, v.hidden_size, cfg.llm.hidden_size)
        self.encoder = (enc, proj, [torch.randn(i, v.num_channels, v.image_size, v.image_size) for i in ENCODER_IMAGES])
        self.kv = None
        if kv_groups:
            enc = ViTEncoder(OmegaConf.merge(v, {"num_layers": 1}), cp_group=kv_groups[rank // cp])
            head_dim = v.hidden_size // v.num_heads
            self.kv = [(enc.cp_plan(i, torch.device("cpu")),
                        [torch.randn(i * enc.local_tokens, v.num_heads, head_dim, requires_grad=True)
                         for _ in range(3)]) for i in KV_IMAGES]

    def __call__(self) -> dict:
        """CPU seconds of one round: "encoder" [ENCODER_IMAGES] (ViT + projector forward +
        backward), "kv" [KV_IMAGES] (one block's CP attention forward + backward, all ranks in
        groups of the CP size), "sync" (the island's gradient sum; island ranks only)."""
        import torch.distributed as dist

        from hcp.model.cp_attention import cp_attention
        from hcp.train.modules import sync_grads

        enc, proj, xs = self.encoder
        out = {"encoder": [_cpu(lambda x=x: proj(enc(x)).sum().backward()) for x in xs]}
        if self.kv is not None:
            out["kv"] = []
            for plan, qkv in self.kv:
                dist.barrier()
                out["kv"].append(_cpu(lambda plan=plan, qkv=qkv: cp_attention(*qkv, plan).sum().backward()))
        dist.barrier()
        if self.sync is not None:
            out["sync"] = _cpu(lambda: sync_grads(*self.sync))
        return out


def _cpu(fn) -> float:
    """Process CPU seconds of `fn()` (every thread of the rank, gloo's included, as the step)."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def floor_units(cfg, cp: int, rounds: list[list[dict]]) -> dict:
    """The floor's unit costs of the ViT of `cfg` at encoder CP size `cp` from every rank's
    `FloorRound` results `rounds` [ranks][rounds]: per rank the least of its rounds, the median
    over the ranks. "encoder": (seconds per FLOP,
    per layer call), the least-squares line over `encoder_flops` (ViT and projector) at
    ENCODER_IMAGES, its intercept over the blocks + 2 layer calls (patch embedding, projector;
    `encoder_work` counts the same); "kv": (seconds per K/V byte a rank receives, per call), the
    line over those bytes at KV_IMAGES; "sync_s": the gradient sum (island ranks)."""
    from hcp.model.flops import encoder_flops
    from hcp.parallel import encoder_cp
    from hcp.preflight.auto_encoders import encoder_cp_share

    def least(key):
        return np.median([np.min([r[key] for r in rank], 0) for rank in rounds if key in rank[0]], 0)

    v = cfg.vision
    flops = [encoder_flops(v, cfg.llm.hidden_size, i) for i in ENCODER_IMAGES]
    per_flop, fixed = np.polyfit(flops, least("encoder"), 1)
    out = {"sync_s": float(least("sync")),
           "encoder": [float(per_flop), max(0.0, float(fixed)) / (v.num_layers + v.select_layer + 3)]}
    if "kv" in rounds[0][0]:
        tokens = (v.image_size // v.patch_size) ** 2 + encoder_cp.LEAD
        per_image = 2 * encoder_cp_share(0.0, tokens, 1, v.hidden_size, cp)[1]   # one block, both passes
        per_byte, fixed = np.polyfit(per_image * np.asarray(KV_IMAGES), least("kv"), 1)
        out["kv"] = [float(per_byte), max(0.0, float(fixed))]
    return out


def island_grad_shapes(cfg) -> list[tuple[int, ...]]:
    """Shapes of the vision island's trainable parameters (its ViT and projector): what its
    gradient sum (`hcp.train.modules.sync_grads`) moves each step."""
    from hcp.model.encoder_types import build_encoder
    from hcp.model.projector import Projector

    modules = (build_encoder(cfg.vision), Projector(cfg.projector, cfg.vision.hidden_size, cfg.llm.hidden_size))
    return [tuple(p.shape) for m in modules for p in m.parameters()]


def encoder_times(work, coef: np.ndarray, floor: np.ndarray, sync_s: float) -> tuple[float, float, float]:
    """(modelled, model bound, floor) seconds of the vision island, medians over the steps of
    `work` ([steps, ranks, 4], `encoder_work`), each plus the step's gradient sum `sync_s`
    (`floor_units`): modelled, the step's most loaded rank at the model's unit costs `coef`;
    model bound, the columns' means over its ranks at `coef` (no layout of the same work can
    do better under the model: its slowest rank does at least the mean); floor, the same means
    at the measured floor unit costs `floor` (module docstring)."""
    w = np.asarray(work)
    return (float(np.median((w @ coef).max(1))) + sync_s, float(np.median(w.mean(1) @ coef)) + sync_s,
            float(np.median(w.mean(1) @ floor)) + sync_s)
