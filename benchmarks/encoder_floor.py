"""The encoder island's cost model and floor of benchmarks/dcp_islands.py (issue 25 section 3):
per rank of a vision island, the work of one step plan (`encoder_work`) and the unit costs
measured on this machine (`measure_kv`, `measure_encoder`, `measure_sync`), combined into a
modelled time and a floor (`encoder_times`).

The floor's unit costs are measured apart from the runs they judge, under the physical costs
every layout of the benchmark pays on this machine: 8 processes at once sharing the cores (as
the benchmark's 8 ranks do: a rank's CPU time per FLOP or per call is higher than alone), each
running the ViT (its FLOPs and layer calls) or, in groups of the CP size, its CP attention;
and the island's gradient sum (one all-reduce of the encoder's gradients over its 4 ranks per
step, which DP and CP layouts alike pay)."""
from __future__ import annotations

import json
import os
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


def _kv_rank(payload) -> None:
    """One rank of `measure_kv`: CPU seconds of the ViT's CP attention forward + backward in its
    group of `cp` consecutive ranks."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hcp.model.cp_attention import cp_attention
    from hcp.model.vit import ViTEncoder

    vision, cp, images, reps, path = payload
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(g, g + cp))) for g in range(0, world, cp)]  # all, in one order
    enc = ViTEncoder(OmegaConf.merge(vision, {"num_layers": 1}), cp_group=groups[rank // cp])
    heads = vision.num_heads
    times = []
    for i in images:
        plan = enc.cp_plan(i, torch.device("cpu"))
        qkv = [torch.randn(i * enc.local_tokens, heads, vision.hidden_size // heads, requires_grad=True)
               for _ in range(3)]
        runs = []
        for k in range(reps + 1):
            dist.barrier()
            t0 = time.process_time()
            cp_attention(*qkv, plan).sum().backward()
            if k:
                runs.append(time.process_time() - t0)
        times.append(min(runs))
    with open(f"{path}.{rank}", "w") as f:
        json.dump(times, f)
    dist.destroy_process_group()


def measure_kv(root: str, vision, cp: int, images=(8, 64), reps: int = 3, procs: int = 8) -> tuple[float, float]:
    """(seconds per K/V byte a rank receives, seconds per call) of encoder CP size `cp`, measured
    here: the CPU time (least of `reps`: a floor) of one block's CP attention (the K/V
    all-gather, the attention over the gathered keys and the backward's reduce-scatter) of the
    ViT `vision` on `procs` forked gloo ranks at once (the benchmark's 8 ranks), in CP groups of
    `cp`, at two image counts, the median over the ranks: the slope over the bytes each rank
    receives (`encoder_work`'s column) and the intercept."""
    from hcp.launch.launch import start_local_ranks
    from hcp.parallel import encoder_cp
    from hcp.preflight.auto_encoders import encoder_cp_share

    path = os.path.join(root, f"kv_{cp}.json")
    start_local_ranks(_kv_rank, procs, (vision, cp, list(images), reps, path), "fork")
    t = np.median([json.load(open(f"{path}.{r}")) for r in range(procs)], 0)
    tokens = (vision.image_size // vision.patch_size) ** 2 + encoder_cp.LEAD
    per_image = 2 * encoder_cp_share(0.0, tokens, 1, vision.hidden_size, cp)[1]   # one block, both passes
    per_byte = (t[1] - t[0]) / (per_image * (images[1] - images[0]))
    return per_byte, max(0.0, t[0] - per_byte * per_image * images[0])


def _encoder_rank(payload) -> None:
    """One process of `measure_encoder`: the least CPU time of `reps` forward + backward passes
    of the ViT at each image count, on one thread."""
    import torch

    from hcp.model.encoder_types import build_encoder

    v, images, reps, path = payload
    torch.set_num_threads(1)
    enc, times = build_encoder(v), []
    for i in images:
        x = torch.randn(i, v.num_channels, v.image_size, v.image_size)
        runs = []
        for k in range(reps + 1):
            t0 = time.process_time()
            enc(x).sum().backward()
            runs.append(time.process_time() - t0)
        times.append(min(runs[1:]))
    with open(f"{path}.{os.environ['RANK']}", "w") as f:
        json.dump(times, f)


def measure_encoder(root: str, cfg, images=(1, 8), reps: int = 4, procs: int = 8) -> tuple[float, float]:
    """(seconds per FLOP, seconds per layer call) of the ViT of `cfg`, no collective, no
    schedule, on `procs` forked processes at once (one thread each: the benchmark's 8 ranks on
    this machine's cores): each process's least CPU time of `reps` forward + backward passes
    at two image counts, the median over the processes; the slope over `encoder_flops` (which
    also counts the projector, not run: the rate errs high) and the intercept over its blocks +
    2 layer calls."""
    from hcp.launch.launch import start_local_ranks
    from hcp.model.flops import encoder_flops

    v, path = cfg.vision, os.path.join(root, f"encoder_{cfg.vision.hidden_size}.json")
    start_local_ranks(_encoder_rank, procs, (v, list(images), reps, path), "fork")
    times = np.median([json.load(open(f"{path}.{r}")) for r in range(procs)], 0)
    per_flop = (times[1] - times[0]) / (encoder_flops(v, cfg.llm.hidden_size, images[1] - images[0]))
    calls = v.num_layers + v.select_layer + 3
    return per_flop, max(0.0, times[0] - per_flop * encoder_flops(v, cfg.llm.hidden_size, images[0])) / calls


def _sync_rank(payload) -> None:
    """One rank of `measure_sync`: the least CPU time of `reps` gradient sums of each shape list."""
    import torch
    import torch.distributed as dist

    from hcp.train.modules import sync_grads

    shape_lists, reps, path = payload
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    times = []
    for shapes in shape_lists:
        params = [torch.zeros(s, requires_grad=True) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape)
        runs = []
        for k in range(reps + 1):
            dist.barrier()
            t0 = time.process_time()
            sync_grads(params, dist.group.WORLD)
            runs.append(time.process_time() - t0)
        times.append(min(runs[1:]))
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def island_grad_shapes(cfg) -> list[tuple[int, ...]]:
    """Shapes of the vision island's trainable parameters (its ViT and projector): what its
    gradient sum (`hcp.train.modules.sync_grads`) moves each step."""
    from hcp.model.encoder_types import build_encoder
    from hcp.model.projector import Projector

    modules = (build_encoder(cfg.vision), Projector(cfg.projector, cfg.vision.hidden_size, cfg.llm.hidden_size))
    return [tuple(p.shape) for m in modules for p in m.parameters()]


def measure_sync(root: str, cfgs, ranks: int = 4, reps: int = 3) -> list[float]:
    """Seconds (CPU, least of `reps`) of one step's gradient sum of the vision island of each
    config in `cfgs` over `ranks` forked gloo ranks: `hcp.train.modules.sync_grads` (one flat
    all-reduce) on gradients of the island's shapes (`island_grad_shapes`)."""
    from hcp.launch.launch import start_local_ranks

    path = os.path.join(root, "sync.json")
    start_local_ranks(_sync_rank, ranks, ([island_grad_shapes(c) for c in cfgs], reps, path), "fork")
    return json.load(open(path))


def encoder_times(work, coef: np.ndarray, floor: np.ndarray, sync_s: float) -> tuple[float, float]:
    """(modelled, bound) seconds of the vision island, medians over the steps of `work`
    ([steps, ranks, 4], `encoder_work`), each plus the step's gradient sum `sync_s`
    (`measure_sync`): modelled, the step's most loaded rank at the model's unit costs `coef`;
    bound, the columns' means over its ranks at the measured floor unit costs `floor` (module
    docstring)."""
    w = np.asarray(work)
    return float(np.median((w @ coef).max(1))) + sync_s, float(np.median(w.mean(1) @ floor)) + sync_s
