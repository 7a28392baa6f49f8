"""Homogeneous vs colocated heterogeneous layouts of an encoder-heavy LLaVA on 4 CPU ranks
(issue 12 section 7).

    python benchmarks/hetero.py                        # 3 timed steps after 1 warm-up
    python benchmarks/hetero.py --steps 5 --json hetero.json

Both layouts run the same global batch, weights and seed on freshly forked gloo ranks, one after
the other in this process tree, and must report the same loss:
- homogeneous (today's behaviour): the LLM at tp2 x cp2; the vision encoder and projector live in
  the LLM's first stage, so every rank of the TP x CP group loads and encodes every image of its
  micro-batches (4x the encoder FLOPs that are needed);
- heterogeneous (colocated, DESIGN.md 4.4): the encoder at dp4 (each rank encodes a quarter of the
  images, once per step), its rows routed by one `all_to_all_single` per direction to the LLM's
  tp2 x cp2 shards (`hcp.comm.boundary`), the three-phase schedule of `hcp.schedule.colocated`.
One step = forward and backward of every micro-batch plus each module's gradient all-reduce over
its own DP x CP group (no optimizer step: it is the same in both).

Reported per layout: step wall time (max over ranks, mean over steps), the critical path (max
over ranks of the step's thread CPU time: the 2 shared cores hide imbalance in wall time),
tokens/s (global merged tokens per wall second), encoder training FLOPs per rank (3 x forward,
analytic), images loaded per rank, and the bytes the boundary routes moved (both directions,
summed over ranks) against the minimum (`hcp.parallel.routing.min_route_rows`).

This runs its own small harness (encoder + route + LLM stage on forked ranks, hand-built static
lanes) rather than the trainer: the routes come from `build_routes` over the same keys the step
plan uses (image rows of each sample; the LLM's CP shards of the merged sequence).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hcp.train.launch import free_port  # noqa: E402

WORLD, LLM_TP, LLM_CP = 4, 2, 2


def configs(args):
    from hcp.config.schema import LLMConfig, ProjectorConfig, VisionConfig

    vision = VisionConfig(image_size=args.image_size, patch_size=args.patch_size, num_channels=1,
                          hidden_size=args.vision_width, num_layers=args.vision_layers,
                          num_heads=args.vision_width // 64, ffn_hidden_size=4 * args.vision_width)
    llm = LLMConfig(vocab_size=256, hidden_size=args.llm_width, num_layers=args.llm_layers,
                    num_heads=args.llm_width // 32, num_kv_heads=args.llm_width // 64,
                    ffn_hidden_size=4 * args.llm_width)
    return vision, ProjectorConfig(), llm


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


def make_data(args, vision):
    """Global batch: sample s has 1 + s % images_per_sample images (every one `patches` rows,
    after a 4-token prompt) and `text_tokens` text tokens; labels -100 at image positions."""
    import torch

    g = torch.Generator().manual_seed(0)
    p = (vision.image_size // vision.patch_size) ** 2
    samples = []
    for s in range(args.samples):
        n_img = 1 + s % args.images_per_sample
        mask = torch.zeros(args.text_tokens + n_img * p, dtype=torch.bool)
        mask[4:4 + n_img * p] = True
        labels = torch.randint(0, 256, (len(mask),), generator=g)
        labels[mask] = -100
        samples.append(dict(ids=torch.randint(0, 256, (len(mask),), generator=g), labels=labels,
                            mask=mask, images=torch.randn(n_img, 1, vision.image_size,
                                                          vision.image_size, generator=g)))
    return samples


class MicroBatch:
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


def route_keys(samples, mbs, enc_dp):
    """Per rank: (keys of its encoder rows, keys its LLM shards need, grad owner, row ranges of
    its micro-batches); keys are global image-row ids (sample offset + row)."""
    import numpy as np

    from hcp.parallel.cp_sharding import cp_shard

    rows = [int(s["mask"].sum()) for s in samples]
    offset = np.concatenate([[0], np.cumsum(rows)])
    per_lane = len(samples) // enc_dp
    src, dst, owner, ranges = [], [], [], []
    for r in range(WORLD):
        lane = range((r % enc_dp) * per_lane, (r % enc_dp + 1) * per_lane)
        src.append(np.concatenate([np.arange(offset[s], offset[s + 1]) for s in lane]))
        tp_i, cp_i = r % LLM_TP, r // LLM_TP
        parts, rr, start = [], [], 0
        for members in mbs:
            mb = MicroBatch(samples, members)
            key = np.full(len(mb.input_ids), -1)
            key[mb.image_mask.numpy()] = np.concatenate(
                [np.arange(offset[s], offset[s + 1]) for s in members])
            shard = cp_shard(mb.cu_seqlens, LLM_CP, cp_i)
            local = np.where(shard.valid.numpy(), key[shard.token_index.numpy()], -1)
            local = local[local >= 0]
            parts.append(local)
            rr.append((start, start + len(local)))
            start += len(local)
        dst.append(np.concatenate(parts))
        owner.append(np.full(len(dst[-1]), tp_i == 0))
        ranges.append(rr)
    return src, dst, owner, ranges


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
    from hcp.parallel.routing import build_routes
    from hcp.schedule.colocated import ColocatedStep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, init_method=f"tcp://127.0.0.1:{port}")
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_group, cp_group = tp_groups[rank // LLM_TP], cp_groups[rank % LLM_TP]
    vision, projector, llm_cfg = configs(args)
    samples = make_data(args, vision)
    per_mb = len(samples) // args.micro_batches
    mbs = [list(range(i * per_mb, (i + 1) * per_mb)) for i in range(args.micro_batches)]
    total = sum(int((s["labels"] != -100).sum()) for s in samples)
    hetero = layout == "heterogeneous"
    model = LlavaModel(vision, projector, llm_cfg, tp_group=tp_group, cp_group=cp_group,
                       encoder=not hetero)
    init_parameters(model, args.seed)
    counter = RouteBytes()
    if hetero:
        encoder = LlavaEncoder(vision, projector, llm_cfg.hidden_size)
        init_parameters(encoder, args.seed)
        src, dst, owner, ranges = route_keys(samples, mbs, WORLD)
        route = build_routes(src, dst, owner, ranks=[rank])[rank]
        lane = range(rank * len(samples) // WORLD, (rank + 1) * len(samples) // WORLD)
        pixels = torch.cat([samples[s]["images"] for s in lane])
        step = ColocatedStep(encoder, None, recompute=False, counter=counter)
        images = pixels.shape[0]
    else:
        images = sum(len(samples[s]["images"]) for s in range(len(samples)))

    def llm_phase(leaf=None):
        loss = torch.zeros((), dtype=torch.float64)
        for i, members in enumerate(mbs):
            mb = MicroBatch(samples, members)
            if leaf is not None:
                a, b = ranges[rank][i]
                mb.image_rows, mb.pixel_values = leaf[a:b], None
            loss_sum, _ = model(mb)
            (loss_sum / total).backward()
            loss += loss_sum.detach().double() / total
        return loss

    records = []
    for it in range(args.warmup + args.steps):
        for p in model.parameters():
            p.grad = None
        if hetero:
            for p in encoder.parameters():
                p.grad = None
        dist.barrier()
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        if hetero:
            loss, _ = step.run(pixels, route, llm_phase)
            _all_reduce_grads(list(encoder.parameters()), None)
        else:
            loss = llm_phase()
        _all_reduce_grads(list(model.parameters()), cp_group)  # dp x cp (dp = 1)
        busy, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
        dist.all_reduce(loss, group=cp_group)
        if it >= args.warmup:
            records.append((busy, wall, float(loss)))
    dist.barrier()
    dist.destroy_process_group()
    return dict(records=records, images=images, route=(counter.forward, counter.backward),
                flops=encoder_flops(vision, llm_cfg.hidden_size, images))


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
            except Exception:  # queue.Empty: check that no rank died without a word
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
    vision, _, llm_cfg = configs(args)
    samples = make_data(args, vision)
    tokens = sum(len(s["ids"]) for s in samples)
    bytes_per_row = llm_cfg.hidden_size * 4
    route = [sum(r["route"][i] for r in per_rank) / (args.warmup + args.steps) for i in (0, 1)]
    if layout == "heterogeneous":
        per_mb = len(samples) // args.micro_batches
        mbs = [list(range(i * per_mb, (i + 1) * per_mb)) for i in range(args.micro_batches)]
        _, dst, _, _ = route_keys(samples, mbs, WORLD)
        minimum = [m * bytes_per_row for m in min_route_rows(dst, [r // LLM_TP for r in range(WORLD)])]
    else:
        minimum = [0, 0]
    step_wall = float(wall.max(axis=0).mean())
    return {
        "loss": per_rank[0]["records"][-1][2],
        "critical_path_s": float(busy.max(axis=0).mean()),
        "mean_busy_s": float(busy.mean()),
        "step_wall_s": step_wall,
        "tokens_per_s": tokens / step_wall,
        "encoder_flops_per_rank": [r["flops"] for r in per_rank],
        "images_per_rank": [r["images"] for r in per_rank],
        "route_bytes": int(sum(route)),
        "route_min_bytes": int(sum(minimum)),
        "route_bytes_by_direction": [int(b) for b in route],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--samples", type=int, default=8, help="global batch size (multiple of 4)")
    ap.add_argument("--micro-batches", type=int, default=2, help="LLM micro-batches per step")
    ap.add_argument("--images-per-sample", type=int, default=2,
                    help="sample s has 1 + s %% this many images")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--patch-size", type=int, default=4)
    ap.add_argument("--vision-width", type=int, default=256)
    ap.add_argument("--vision-layers", type=int, default=4)
    ap.add_argument("--llm-width", type=int, default=256)
    ap.add_argument("--llm-layers", type=int, default=4)
    ap.add_argument("--text-tokens", type=int, default=96, help="text tokens per sample")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    if args.samples % WORLD or args.samples % args.micro_batches:
        ap.error(f"--samples {args.samples} must be a multiple of {WORLD} and of --micro-batches")
    if args.vision_width % 64 or args.llm_width % 128:
        ap.error("--vision-width must be a multiple of 64 (head size 64) and --llm-width of 128 "
                 "(head size 32, kv heads split over TP 2)")

    from hcp.train.throughput import model_flops

    vision, _, llm_cfg = configs(args)
    samples = make_data(args, vision)
    images = sum(len(s["images"]) for s in samples)
    lengths = [len(s["ids"]) for s in samples]
    llm_per_rank = model_flops(llm_cfg, sum(lengths), sum(n * n for n in lengths)) / WORLD
    enc_homo = encoder_flops(vision, llm_cfg.hidden_size, images)
    share = enc_homo / (enc_homo + llm_per_rank)
    print(f"global batch: {len(samples)} samples, {images} images of {vision.image_size}x"
          f"{vision.image_size} ({(vision.image_size // vision.patch_size) ** 2} patches), "
          f"{sum(lengths)} merged tokens; ViT {vision.num_layers}x{vision.hidden_size}, LLM "
          f"{llm_cfg.num_layers}x{llm_cfg.hidden_size}, LLM tp{LLM_TP} x cp{LLM_CP} on {WORLD} ranks")
    print(f"encoder share of the homogeneous step's FLOPs per rank: {share:.0%}")

    layouts = {name: run_layout(name, args) for name in ("homogeneous", "heterogeneous")}
    head = (f"{'layout':<14} {'loss':>8} {'critical s':>10} {'wall s':>8} {'tokens/s':>9} "
            f"{'enc GFLOP/rank':>15} {'images/rank':>12} {'route MB':>9} {'min MB':>7}")
    print(head)
    for name, r in layouts.items():
        print(f"{name:<14} {r['loss']:8.5f} {r['critical_path_s']:10.3f} {r['step_wall_s']:8.3f} "
              f"{r['tokens_per_s']:9.0f} {max(r['encoder_flops_per_rank']) / 1e9:15.2f} "
              f"{'/'.join(map(str, r['images_per_rank'])):>12} {r['route_bytes'] / 1e6:9.3f} "
              f"{r['route_min_bytes'] / 1e6:7.3f}")
    homo, het = layouts["homogeneous"], layouts["heterogeneous"]
    speedup = homo["critical_path_s"] / het["critical_path_s"]
    print(f"critical-path speed-up {speedup:.2f}x (target >= 1.3x), wall speed-up "
          f"{homo['step_wall_s'] / het['step_wall_s']:.2f}x, loss difference "
          f"{abs(homo['loss'] - het['loss']):.2e}")
    out = {"config": {**vars(args), "encoder_flops_share_homogeneous": share},
           "layouts": layouts, "critical_path_speedup": speedup}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
