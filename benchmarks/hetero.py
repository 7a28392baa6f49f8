"""Homogeneous vs colocated heterogeneous layouts of an encoder-heavy LLaVA on 4 CPU ranks
(issue 12 section 7).

    python benchmarks/hetero.py                        # 3 timed steps after 1 warm-up
    python benchmarks/hetero.py --steps 5 --json hetero.json
    python benchmarks/hetero.py vision.num_layers=6 vision.layout.tp=2   # any config override

The configuration is `+recipe=llava_tiny_hetero` (encoder tp1 x dp4, LLM tp2 x cp2 on 4 ranks)
with a wider ViT on larger images (`MODEL` below, stated in the output) so that the encoder
carries at least 40% of the homogeneous step's FLOPs; trailing Hydra overrides change it. Both
layouts run the same global batch (synthetic samples with 1 or 2 images), the same step plan
(`hcp.plan.plan_step`: first-fit micro-batches, CP shards, routes), weights and seed, on freshly
forked gloo ranks one after the other in this process tree, and must report the same loss:
- homogeneous (the behaviour before issue 12): the vision encoder and projector live in the
  LLM's first stage, so every rank of the LLM's TP x CP group loads and encodes every image of
  its micro-batches (`LlavaModel(encoder=True)`);
- heterogeneous (colocated, DESIGN.md 4.4): the encoder side under its own layout
  (`LlavaEncoder`), each image encoded once per step by its encoder lane, its rows routed by one
  `all_to_all_single` per direction (`hcp.comm.boundary`) in the three-phase schedule of
  `hcp.schedule.colocated`, as the trainer runs it.
One step = forward and backward of every micro-batch plus each module's gradient all-reduce over
its own DP (x CP) group; data loading and the optimizer step are left out (the same in both).
The trainer itself can no longer run the homogeneous layout, hence this harness.

Reported per layout: step wall time (max over ranks, mean over steps), the critical path (max
over ranks of the step's thread CPU time, mean over steps: the 2 shared cores hide imbalance in
wall time), tokens/s (global merged tokens per wall second), encoder training FLOPs per rank
(3 x forward, analytic), images loaded and encoded per rank, and the bytes the boundary routes
moved (both directions, summed over ranks) against the minimum
(`hcp.parallel.routing.min_route_rows`).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hcp.train.launch import free_port  # noqa: E402

WORLD = 4
PHASES = ("encoder_forward", "route_forward", "llm", "route_backward", "encoder_backward")
MODEL = ["vision.image_size=32", "vision.patch_size=4", "vision.hidden_size=256",
         "vision.num_layers=4", "vision.num_heads=4", "vision.ffn_hidden_size=1024",
         "llm.hidden_size=256", "llm.num_layers=4", "llm.num_heads=8", "llm.num_kv_heads=4",
         "llm.ffn_hidden_size=768", "trainer.micro_batch_tokens=512"]


def compose(overrides):
    """(config, resolved layouts) of the benchmark's run."""
    from hcp.config.compose import compose_config
    from hcp.config.layouts import resolve_layouts

    cfg = compose_config(["+recipe=llava_tiny_hetero", *MODEL, *overrides])
    return cfg, resolve_layouts(cfg, WORLD)


def encoder_flops(vision, llm_hidden: int, images: int) -> float:
    """Training FLOPs (3 x forward) of the ViT + mlp2x_gelu projector over `images` images:
    matrix multiplies 2 * tokens * weights per block, attention 4 * S^2 * D per image and block
    (S = patches + CLS), patch embedding and projector over the patches."""
    p = (vision.image_size // vision.patch_size) ** 2
    s, d, f = p + 1, vision.hidden_size, vision.ffn_hidden_size
    used = vision.num_layers + vision.select_layer + 1
    block = 2 * s * (4 * d * d + 2 * d * f) + 4 * s * s * d
    embed = 2 * p * vision.num_channels * vision.patch_size ** 2 * d
    projector = 2 * p * (d * llm_hidden + llm_hidden * llm_hidden)
    return 3.0 * images * (used * block + embed + projector)


def make_data(cfg, num_samples: int, text_tokens: int):
    """(samples, their `SampleSizes`): sample s has 1 + s % 2 images (each `patches` rows, the
    first after a 4-token prompt, the second in the middle of the text) and `text_tokens` text
    tokens; labels -100 at image positions."""
    import numpy as np
    import torch

    from hcp.plan.lengths import SampleSizes

    v = cfg.vision
    g = torch.Generator().manual_seed(0)
    p = (v.image_size // v.patch_size) ** 2
    samples, starts = [], []
    for s in range(num_samples):
        n_img = 1 + s % 2
        at = [4 + i * (p + text_tokens // 2) for i in range(n_img)]
        mask = torch.zeros(text_tokens + n_img * p, dtype=torch.bool)
        for a in at:
            mask[a:a + p] = True
        labels = torch.randint(0, cfg.llm.vocab_size, (len(mask),), generator=g)
        labels[mask] = -100
        samples.append(dict(ids=torch.randint(0, cfg.llm.vocab_size, (len(mask),), generator=g),
                            labels=labels, mask=mask,
                            images=torch.randn(n_img, v.num_channels, v.image_size, v.image_size,
                                               generator=g)))
        starts += at
    images = np.array([len(x["images"]) for x in samples], dtype=np.int64)
    sizes = SampleSizes(tokens=np.array([len(x["ids"]) for x in samples], dtype=np.int64),
                        loss_tokens=np.array([int((x["labels"] != -100).sum()) for x in samples],
                                             dtype=np.int64),
                        image_offsets=np.concatenate([[0], np.cumsum(images)]).astype(np.int64),
                        image_starts=np.array(starts, dtype=np.int64),
                        image_rows_each=np.full(int(images.sum()), p, dtype=np.int64))
    return samples, sizes


class MicroBatch:
    """One packed micro-batch of `samples` (THD, the attributes `LlavaModel` reads)."""

    def __init__(self, samples, members):
        import torch

        lengths = [len(samples[s]["ids"]) for s in members]
        self.input_ids = torch.cat([samples[s]["ids"] for s in members])
        self.labels = torch.cat([samples[s]["labels"] for s in members])
        self.image_mask = torch.cat([samples[s]["mask"] for s in members])
        self.pixel_values = torch.cat([samples[s]["images"] for s in members])
        self.position_ids = torch.cat([torch.arange(n) for n in lengths])
        self.cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        self.max_seqlen = max(lengths)
        self.image_rows = None


def _all_reduce_grads(params, group) -> None:
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
        p.grad = g


def _rank(rank, port, layout, args, queue):
    try:
        queue.put((rank, _measure(rank, port, layout, args)))
    except BaseException:  # noqa: BLE001 - hand the failure to the parent instead of hanging it
        import traceback

        queue.put((rank, traceback.format_exc()))


def _measure(rank, port, layout, args) -> dict:
    import torch
    import torch.distributed as dist

    from hcp.comm.boundary import RouteBytes
    from hcp.model import init_parameters
    from hcp.model.llava import LlavaEncoder, LlavaModel
    from hcp.parallel.groups import ProcessGroupRegistry
    from hcp.plan.step import plan_step
    from hcp.schedule.colocated import ColocatedStep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, init_method=f"tcp://127.0.0.1:{port}")
    cfg, layouts = compose(args.overrides)
    groups = ProcessGroupRegistry(layouts)
    llm = layouts["llm"]
    size1 = lambda g, n: g if n > 1 else None  # noqa: E731 - the model takes None for size 1
    tp_group, cp_group = size1(groups.group("llm", "tp"), llm.tp), size1(groups.group("llm", "cp"), llm.cp)
    samples, sizes = make_data(cfg, args.samples, args.text_tokens)
    edges = tuple(tuple(e) for e in cfg.graph.edges)
    mine = plan_step(sizes, layouts, cfg.packing, cfg.trainer.micro_batch_tokens, edges).rank(rank)
    mbs = [mb for mb in mine.micro_batches if not mb.empty]
    total = int(sizes.loss_tokens.sum())
    hetero = layout == "heterogeneous"
    model = LlavaModel(cfg.vision, cfg.projector, cfg.llm, tp_group=tp_group, cp_group=cp_group,
                       encoder=not hetero)
    init_parameters(model, cfg.seed)
    counter = RouteBytes()
    if hetero:
        vision_tp = size1(groups.group("vision", "tp"), layouts["vision"].tp)
        encoder = LlavaEncoder(cfg.vision, cfg.projector, cfg.llm.hidden_size, tp_group=vision_tp)
        init_parameters(encoder, cfg.seed)
        encoded = mine.encoder_samples["vision"]
        pixels = torch.cat([samples[s]["images"] for s in encoded])
        route = mine.routes[next(e for e in mine.routes if e[1] == "llm")]
        step = ColocatedStep(encoder, None, cfg.vision.layout.recompute == "full", counter)
    else:
        encoded = [s for mb in mbs for s in mb.samples]
    images = sum(len(samples[s]["images"]) for s in encoded)

    def llm_phase(leaf=None):
        loss = torch.zeros((), dtype=torch.float64)
        for mb in mbs:
            batch = MicroBatch(samples, mb.samples)
            if leaf is not None:
                batch.image_rows, batch.pixel_values = leaf[mb.image_rows[0]:mb.image_rows[1]], None
            loss_sum, _ = model(batch)
            (loss_sum / total).backward()
            loss += loss_sum.detach().double() / total
        return loss

    records, phases = [], []
    for it in range(args.warmup + args.steps):
        params = list(model.parameters()) + (list(encoder.parameters()) if hetero else [])
        for p in params:
            p.grad = None
        dist.barrier()
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        if hetero:
            loss, times = step.run(pixels, route, llm_phase)
            _all_reduce_grads(list(encoder.parameters()), groups.group("vision", "dp"))
        else:
            loss = llm_phase()
        _all_reduce_grads(list(model.parameters()), groups.group("llm", "dp_cp"))
        busy, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
        dist.all_reduce(loss, group=groups.group("llm", "dp_cp"))
        if it >= args.warmup:
            records.append((busy, wall, float(loss)))
            if hetero:
                phases.append([getattr(times, k) for k in PHASES])
    dist.barrier()
    dist.destroy_process_group()
    return dict(records=records, images=images, route=(counter.forward, counter.backward),
                flops=encoder_flops(cfg.vision, cfg.llm.hidden_size, images) /
                (layouts["vision"].tp if hetero else 1),
                dst_keys=_dst_keys(mine, sizes, samples, mbs) if hetero else None,
                micro_batches=len(mbs), phases=phases)


def _dst_keys(mine, sizes, samples, mbs):
    """Global image-row ids this rank's LLM shards need (for the minimum route bytes): the image
    rows of each micro-batch's CP shard of the merged sequence, read from the plan."""
    import numpy as np

    from hcp.parallel.cp_sharding import cp_shard

    offset = np.concatenate([[0], np.cumsum([int(s["mask"].sum()) for s in samples])])
    parts = []
    for mb in mbs:
        batch = MicroBatch(samples, mb.samples)
        key = np.full(len(batch.input_ids), -1)
        key[batch.image_mask.numpy()] = np.concatenate(
            [np.arange(offset[s], offset[s + 1]) for s in mb.samples])
        shard = cp_shard(batch.cu_seqlens, mb.cp_size, mb.cp_rank)
        local = np.where(shard.valid.numpy(), key[shard.token_index.numpy()], -1)
        parts.append(local[local >= 0])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def run_layout(layout: str, args) -> dict:
    import numpy as np

    from hcp.parallel.routing import min_route_rows

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, layout, args, queue), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < WORLD:
            try:
                rank, payload = queue.get(timeout=5)
            except queue_mod.Empty:  # no word yet: make sure no rank died silently
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{layout}: rank {dead[0]} died (exit code "
                                       f"{procs[dead[0]].exitcode})") from None
                continue
            if isinstance(payload, str):
                raise RuntimeError(f"{layout}: rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    per_rank = [results[r] for r in range(WORLD)]
    busy = np.array([[rec[0] for rec in r["records"]] for r in per_rank])   # [ranks, steps]
    wall = np.array([[rec[1] for rec in r["records"]] for r in per_rank])
    cfg, layouts = compose(args.overrides)
    _, sizes = make_data(cfg, args.samples, args.text_tokens)
    steps = args.warmup + args.steps
    route = [sum(r["route"][i] for r in per_rank) / steps for i in (0, 1)]
    minimum = [0, 0]
    if layout == "heterogeneous":
        llm = layouts["llm"]
        shard_of = [r // llm.tp for r in range(WORLD)]  # the ranks of one TP group: one shard
        rows = min_route_rows([r["dst_keys"] for r in per_rank], shard_of)
        minimum = [n * cfg.llm.hidden_size * 4 for n in rows]
    step_wall = float(wall.max(axis=0).mean())
    extra = {}
    if layout == "heterogeneous":  # thread CPU s per phase: max over ranks, mean over steps
        ph = np.array([r["phases"] for r in per_rank])                  # [ranks, steps, phases]
        extra["phase_busy_s"] = dict(zip(PHASES, ph.max(axis=0).mean(axis=0).round(4).tolist()))
    return {**extra,
        "loss": per_rank[0]["records"][-1][2],
        "critical_path_s": float(busy.max(axis=0).mean()),
        "mean_busy_s": float(busy.mean()),
        "step_wall_s": step_wall,
        "tokens_per_s": float(sizes.tokens.sum()) / step_wall,
        "encoder_flops_per_rank": [r["flops"] for r in per_rank],
        "images_per_rank": [r["images"] for r in per_rank],
        "micro_batches_per_rank": [r["micro_batches"] for r in per_rank],
        "route_bytes": int(sum(route)),
        "route_min_bytes": int(sum(minimum)),
        "route_bytes_by_direction": [int(b) for b in route],
        "route_min_bytes_by_direction": [int(b) for b in minimum],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--samples", type=int, default=8,
                    help="global batch size (a multiple of every module's dp)")
    ap.add_argument("--text-tokens", type=int, default=96, help="text tokens per sample")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("overrides", nargs="*", help="config overrides, as for train.py")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.samples < 1 or args.text_tokens < 8:
        ap.error("--steps >= 1, --warmup >= 0, --samples >= 1 and --text-tokens >= 8 are needed")
    if args.json and os.path.isdir(args.json):
        ap.error(f"--json {args.json} is a directory: give a file path")
    cfg, layouts = compose(args.overrides)
    for m, lay in layouts.items():
        if args.samples % lay.dp:
            ap.error(f"--samples {args.samples} does not split into {m}'s dp={lay.dp} lanes")

    from hcp.plan.step import plan_step
    from hcp.train.throughput import model_flops

    _, sizes = make_data(cfg, args.samples, args.text_tokens)
    plan = plan_step(sizes, layouts, cfg.packing, cfg.trainer.micro_batch_tokens,
                     tuple(tuple(e) for e in cfg.graph.edges))
    llm, v = layouts["llm"], cfg.vision
    images = int(sizes.images.sum())
    lengths = sizes.tokens.astype(float)
    llm_per_rank = model_flops(cfg.llm, lengths.sum(), (lengths ** 2).sum()) / (llm.tp * llm.cp * llm.dp)
    enc_homo = encoder_flops(v, cfg.llm.hidden_size, images / llm.dp)
    share = enc_homo / (enc_homo + llm_per_rank)
    lay = lambda m: "x".join(f"{a}{getattr(layouts[m], a)}" for a in ("tp", "cp", "pp", "dp"))  # noqa: E731
    print(f"global batch: {args.samples} samples, {images} images of {v.image_size}x{v.image_size} "
          f"({(v.image_size // v.patch_size) ** 2} patches each), {int(lengths.sum())} merged tokens "
          f"in {plan.num_micro_batches} micro-batches per lane; ViT {v.num_layers}x{v.hidden_size} "
          f"(ffn {v.ffn_hidden_size}), LLM {cfg.llm.num_layers}x{cfg.llm.hidden_size} (ffn "
          f"{cfg.llm.ffn_hidden_size}); LLM {lay('llm')}, heterogeneous encoder {lay('vision')}, "
          f"{WORLD} CPU ranks")
    print(f"encoder share of the homogeneous step's FLOPs per rank: {share:.0%}")

    results = {name: run_layout(name, args) for name in ("homogeneous", "heterogeneous")}
    print(f"{'layout':<14} {'loss':>8} {'critical s':>10} {'wall s':>8} {'tokens/s':>9} "
          f"{'enc GFLOP/rank':>15} {'images/rank':>12} {'route MB':>9} {'min MB':>7}")
    for name, r in results.items():
        print(f"{name:<14} {r['loss']:8.5f} {r['critical_path_s']:10.3f} {r['step_wall_s']:8.3f} "
              f"{r['tokens_per_s']:9.0f} {max(r['encoder_flops_per_rank']) / 1e9:15.2f} "
              f"{'/'.join(map(str, r['images_per_rank'])):>12} {r['route_bytes'] / 1e6:9.3f} "
              f"{r['route_min_bytes'] / 1e6:7.3f}")
    homo, het = results["homogeneous"], results["heterogeneous"]
    print("heterogeneous phases (thread CPU s, max over ranks): " + ", ".join(
        f"{k} {v:.3f}" for k, v in het["phase_busy_s"].items()))
    speedup = homo["critical_path_s"] / het["critical_path_s"]
    print(f"critical-path speed-up {speedup:.2f}x (target >= 1.3x), wall speed-up "
          f"{homo['step_wall_s'] / het['step_wall_s']:.2f}x, loss difference "
          f"{abs(homo['loss'] - het['loss']):.2e}")
    out = {"config": {"overrides": [*MODEL, *args.overrides], "steps": args.steps,
                      "warmup": args.warmup, "samples": args.samples,
                      "text_tokens": args.text_tokens, "encoder_flops_share_homogeneous": share},
           "layouts": results, "critical_path_speedup": speedup}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
