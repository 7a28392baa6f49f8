"""One rank's part of `benchmarks/hetero.py`: runs timed training steps of one layout on a forked
gloo rank and returns what it measured.

Three layouts of the same model, batch, step plan (`hcp.plan.plan_step`: first-fit micro-batches,
CP shards), weights and seed; the LLM always runs the graph-aware 1F1B executor
(`hcp.schedule.executor`, a plain 1F1B for one module):
- `homogeneous` (before issue 12): the vision encoder and projector live in the LLM's first PP
  stage (`LlavaModel(encoder=True)`), so every rank of a first-stage TP x CP group encodes every
  image of its micro-batches, inside the LLM's pipeline;
- `heterogeneous` (colocated, docs/design.md 4.4): the encoder side (`LlavaEncoder`) on every rank
  under its own layout, the three-phase `ColocatedStep` around the LLM's pipeline, image rows
  moved by one `all_to_all_single` per direction (the step plan's route);
- `non_colocated`: the encoder side on its own island of ranks, as a stage before the LLM's
  first stage in one graph-aware 1F1B (`hcp.schedule.graph`), per micro-batch: each encoder lane
  encodes its samples of that micro-batch and a batched P2P route (`hcp.comm.island` via
  `RouteLink`) delivers the rows to the CP rank that holds their positions; lanes and routes are
  the step plan's (`RankPlan.encoder_micro_batches` / `island_routes`, as the trainer's
  `hcp.train.islands` runs them, block lanes);
- `non_colocated_interleaved`: the same with every micro-batch's samples dealt over the encoder
  lanes (`interleaved_lanes`, routes from `build_routes` over the same edge group).
The encoder here is `LlavaEncoder` whole on each island rank (encoder pp 1; the trainer's
`hcp.model.encoder_stage` also splits it over island stages).
One step = forward and backward of every micro-batch plus each module's gradient all-reduce over
its own DP (x CP) group; data loading and the optimizer step are left out (the same in all).
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from harness import report  # beside this file (benchmarks/hetero.py puts it on the path)
from hcp.model.flops import encoder_flops  # noqa: F401  (hetero.py and hetero_plan.py import it from here)

PHASES = ("encoder_forward", "route_forward", "llm", "route_backward", "encoder_backward")


def compose(overrides):
    """(config, layouts resolved over `launcher.nproc_per_node` ranks) of the overrides."""
    from hcp.config.compose import compose_config
    from hcp.config.layouts import resolve_layouts

    cfg = compose_config(["+recipe=llava_tiny_hetero", *overrides])
    return cfg, resolve_layouts(cfg, int(cfg.launcher.nproc_per_node))


def make_data(cfg, num_samples: int, text_tokens: int):
    """(samples, their `SampleSizes`): sample s has 1 + s % 2 images (each `patches` rows, the
    first after a 4-token prompt, the second in the middle of the text) and `text_tokens` text
    tokens; labels -100 at image positions."""
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
        lengths = [len(samples[s]["ids"]) for s in members]
        self.input_ids = torch.cat([samples[s]["ids"] for s in members])
        self.labels = torch.cat([samples[s]["labels"] for s in members])
        self.image_mask = torch.cat([samples[s]["mask"] for s in members])
        self.pixel_values = torch.cat([samples[s]["images"] for s in members])
        self.position_ids = torch.cat([torch.arange(n) for n in lengths])
        self.cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        self.max_seqlen = max(lengths)
        self.image_rows = None


def row_offsets(samples) -> np.ndarray:
    """[B + 1] first global image-row id of each sample (rows in sample order)."""
    return np.concatenate([[0], np.cumsum([int(s["mask"].sum()) for s in samples])]).astype(np.int64)


def dst_keys(mb, samples, offset) -> np.ndarray:
    """Global image-row ids one LLM rank needs for micro-batch `mb` (its `MicroBatchPlan`): the
    image rows of its CP shard of the merged sequence, in local slot order."""
    from hcp.parallel.cp_sharding import cp_shard

    if mb.empty:
        return np.zeros(0, dtype=np.int64)
    batch = MicroBatch(samples, mb.samples)
    key = np.full(len(batch.input_ids), -1)
    key[batch.image_mask.numpy()] = np.concatenate(
        [np.arange(offset[s], offset[s + 1]) for s in mb.samples])
    shard = cp_shard(batch.cu_seqlens, mb.cp_size, mb.cp_rank)
    local = np.where(shard.valid.numpy(), key[shard.token_index.numpy()], -1)
    return local[local >= 0].astype(np.int64)


def interleaved_lanes(plan, dp: int) -> dict[int, list[list[int]]]:
    """{lane: [micro-batch][samples]} of an encoder island's `dp` lanes when every micro-batch's
    samples (in the LLM's consumption order) are dealt over the lanes, each to the lane with the
    fewest image rows in that micro-batch (then in the step), so every lane encodes part of every
    micro-batch. The step plan's block lanes (lane e encodes block e of the batch) serialize a
    fan-in edge's lanes instead, since the LLM consumes the blocks one after another."""
    consumed = [[s for g in r.groups for s in g.seq_indices] for r in plan.packing.rounds]
    lanes = {e: [[] for _ in consumed] for e in range(dp)}
    rows = plan.sizes.image_rows
    step = [0] * dp
    for i, mb in enumerate(consumed):
        here = [0] * dp
        for s in mb:
            e = min(range(dp), key=lambda e: (here[e], step[e], e))
            lanes[e][i].append(s)
            here[e] += int(rows[s])
            step[e] += int(rows[s])
    return lanes


def island_side(plan, layouts, samples, rank: int, interleave: bool):
    """This rank's part of the non-colocated edge vision -> llm, per micro-batch.

    Block lanes (`interleave` False): the step plan's own (`RankPlan.encoder_micro_batches`,
    `RankPlan.island_routes`, planned with `island_route="direct"`). Interleaved lanes
    (`interleaved_lanes`): routes built here by `build_routes` over the same edge group
    (`edge_ranks`: the encoder's ranks, then the LLM's first-stage ranks; every TP rank of a
    destination receives, TP rank 0 returns the gradient).

    Returns (edge group ranks, this rank's RankRoute per micro-batch or None outside the group,
    its encoder samples per micro-batch or None off the encoder island, the image-row ids it
    needs over the step: the minimum bytes' input, computed from the CP shards independently of
    the routes)."""
    from hcp.parallel.grid import Grid
    from hcp.parallel.islands import edge_ranks
    from route_keys import build_routes  # beside this file (benchmarks/hetero.py puts it on the path)

    vis, llm = Grid.of(layouts["vision"]), Grid.of(layouts["llm"])
    ranks = edge_ranks(vis, llm)
    offset = row_offsets(samples)
    dst_plans = {r: plan.rank(r).micro_batches for r in ranks if llm.contains(r)}
    keys = {r: [dst_keys(mb, samples, offset) for mb in dst_plans[r]] for r in dst_plans}
    needed = np.concatenate(keys[rank]) if rank in keys else np.zeros(0, np.int64)
    if rank not in ranks:
        return ranks, None, None, needed
    if not interleave:
        mine = plan.rank(rank)
        edge = next(e for e in mine.island_routes if e[1] == "llm")
        if plan.island_ranks[edge] != ranks:
            raise AssertionError(f"edge group {plan.island_ranks[edge]} != {ranks}")
        return ranks, list(mine.island_routes[edge]), mine.encoder_micro_batches.get("vision"), needed
    lanes = interleaved_lanes(plan, vis.dp)
    me, routes = ranks.index(rank), []
    empty = np.zeros(0, np.int64)
    for i in range(plan.num_micro_batches):
        src, dst, owner = [], [], []
        for r in ranks:
            if vis.contains(r):
                lane_mb = lanes[vis.coords(r)["dp"]][i]
                src.append(np.concatenate([np.arange(offset[s], offset[s + 1]) for s in lane_mb])
                           if lane_mb else empty)
                dst.append(empty)
                owner.append(np.zeros(0, bool))
            else:
                src.append(empty)
                dst.append(keys[r][i])
                owner.append(np.full(len(keys[r][i]), llm.coords(r)["tp"] == 0))
        routes.append(build_routes(src, dst, owner, ranks=[me])[me])
    lane = lanes[vis.coords(rank)["dp"]] if vis.contains(rank) else None
    return ranks, routes, lane, needed


def schedule_graph(cfg, layouts):
    """The `StageGraph` the step's pipeline runs: the encoder island as one stage before the LLM's
    stages under `non_colocated`, the LLM's stages alone otherwise."""
    from hcp.schedule.graph import stage_graph

    if cfg.placement == "non_colocated":
        return stage_graph({"vision": layouts["vision"].pp, "llm": layouts["llm"].pp}, [["vision", "llm"]])
    return stage_graph({"llm": layouts["llm"].pp}, [])


def run_rank(rank: int, world: int, port: int, name: str, composed, args, queue) -> None:
    """Fork target (`harness.fork_ranks`): measure, put (rank, result dict or traceback text) on
    `queue`. composed: `compose(overrides)`, done once in the parent (Hydra is slow to start)."""
    report(queue, rank, _measure, rank, world, port, name, composed, args)


def _measure(rank, world, port, name, composed, args) -> dict:
    from hcp.comm.boundary import RouteBytes
    from hcp.comm.island import IslandEdge
    from hcp.model import init_parameters
    from hcp.model.llava import LlavaEncoder, LlavaModel
    from hcp.model.stage import StageSpec
    from hcp.parallel.grid import Grid
    from hcp.parallel.groups import ProcessGroupRegistry
    from hcp.plan.step import plan_step
    from hcp.schedule.colocated import ColocatedStep
    from hcp.schedule.graph import graph_one_f_one_b
    from hcp.schedule.executor import Executor
    from hcp.schedule.links import PipeLink, RouteLink
    from hcp.train.modules import sync_grads

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    cfg, layouts = composed
    groups = ProcessGroupRegistry(layouts)
    llm, vis = layouts["llm"], layouts["vision"]
    llm_grid, vis_grid = Grid.of(llm), Grid.of(vis)
    island = cfg.placement == "non_colocated"
    samples, sizes = make_data(cfg, args.samples, args.text_tokens)
    edges = tuple(tuple(e) for e in cfg.graph.edges)
    plan = plan_step(sizes, layouts, cfg.packing, cfg.trainer.micro_batch_tokens, edges, island_route="direct")
    mine = plan.rank(rank)
    total = int(sizes.loss_tokens.sum())
    num_micro = plan.num_micro_batches
    hidden = cfg.llm.hidden_size
    counter = RouteBytes()
    size1 = lambda g, n: g if n > 1 else None  # noqa: E731 - the models take None for size 1
    graph = schedule_graph(cfg, layouts)
    gidx = graph.index
    model = encoder = step = None
    links, inputs_key, encoded = {}, None, ()
    if llm_grid.contains(rank):
        c = llm_grid.coords(rank)
        spec = StageSpec.of(llm.pp_layers, c["pp"])
        model = LlavaModel(cfg.vision, cfg.projector, cfg.llm, size1(groups.group("llm", "tp"), llm.tp),
                           size1(groups.group("llm", "cp"), llm.cp), stage=spec,
                           encoder=name == "homogeneous")
        init_parameters(model, cfg.seed)
        if any(mb.empty for mb in mine.micro_batches):
            raise ValueError("an LLM lane has an empty micro-batch: choose --samples so that every "
                             "lane fills each micro-batch")
        batches = [MicroBatch(samples, mb.samples) for mb in mine.micro_batches]
        stage_id = gidx("llm", c["pp"])
        for d in (-1, 1):
            if 0 <= c["pp"] + d < llm.pp:
                peer = int(llm_grid.ranks[c["pp"] + d, c["dp"], c["cp"], c["tp"]])
                links[gidx("llm", c["pp"] + d)] = PipeLink(
                    peer, lambda i, m=model: (m.residual_shape(batches[i]), torch.float32))
        if name == "homogeneous" and spec.first:
            encoded = [s for mb in mine.micro_batches for s in mb.samples]
    if vis_grid.contains(rank) and name != "homogeneous":
        encoder = LlavaEncoder(cfg.vision, cfg.projector, hidden,
                               tp_group=size1(groups.group("vision", "tp"), vis.tp))
        init_parameters(encoder, cfg.seed)
        encoded = mine.encoder_samples["vision"]
    if island:
        ranks, routes, lane, needed = island_side(plan, layouts, samples, rank, name.endswith("interleaved"))
        edge = None if routes is None else IslandEdge(ranks, ranks.index(rank))
        if vis_grid.contains(rank):
            stage_id = gidx("vision", 0)
            encoded = [s for mb in lane for s in mb]
            links[gidx("llm", 0)] = RouteLink(edge, routes, hidden, torch.float32, counter=counter)
            pixels = [torch.cat([samples[s]["images"] for s in lane[i]]) if lane[i] else None
                      for i in range(num_micro)]
        elif edge is not None:
            inputs_key = gidx("vision", 0)
            links[inputs_key] = RouteLink(edge, routes, hidden, torch.float32, counter=counter)
    elif name == "heterogeneous":
        route = mine.routes[next(e for e in mine.routes if e[1] == "llm")]
        step = ColocatedStep(encoder, None, cfg.vision.layout.recompute == "full", counter)
        pixels_step = torch.cat([samples[s]["images"] for s in encoded])
    images = sum(len(samples[s]["images"]) for s in encoded)
    programs = graph_one_f_one_b(graph, num_micro)

    fwd, bwd = [0.0] * num_micro, [0.0] * num_micro
    loss = torch.zeros((), dtype=torch.float64)

    class Timed(Executor):
        def _backward(self, i):
            t0 = time.thread_time()
            super()._backward(i)
            bwd[i] += time.thread_time() - t0

    def timed(fn):
        def forward(i, inputs):
            t0 = time.thread_time()
            out = fn(i, inputs)
            fwd[i] += time.thread_time() - t0
            return out
        return forward

    def encoder_forward(i, inputs):
        if pixels[i] is None:
            return torch.zeros(0, hidden)
        return encoder(pixels[i])

    def llm_forward(i, inputs, leaf=None):
        nonlocal loss
        batch = batches[i]
        x = None
        if model.stage.first:
            if inputs_key is not None:
                batch.image_rows, batch.pixel_values = inputs[inputs_key], None
            elif leaf is not None:
                lo, hi = mine.micro_batches[i].image_rows
                batch.image_rows, batch.pixel_values = leaf[lo:hi], None
        else:
            x = inputs[stage_id - 1]
        out = model(batch, x)
        if not model.stage.last:
            return out
        loss = loss + out[0].detach().double() / total
        return out[0] / total

    records, per_micro, phases = [], [], []
    params = [*(model.parameters() if model is not None else ()),
              *(encoder.parameters() if encoder is not None else ())]
    for it in range(args.warmup + args.steps):
        for p in params:
            p.grad = None
        fwd[:], bwd[:] = [0.0] * num_micro, [0.0] * num_micro
        loss = torch.zeros((), dtype=torch.float64)
        if model is not None:
            batches = [MicroBatch(samples, mb.samples) for mb in mine.micro_batches]
        dist.barrier()
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        if step is not None:
            def llm_phase(leaf):
                Timed(timed(lambda i, inp: llm_forward(i, inp, leaf)), links).run(programs[stage_id])
            _, times = step.run(pixels_step, route, llm_phase)
        else:
            fn = llm_forward if model is not None else encoder_forward
            Timed(timed(fn), links).run(programs[stage_id])
        if encoder is not None:  # the trainer's gradient sums (hcp.train.modules.sync_grads)
            sync_grads(encoder.parameters(), groups.group("vision", "dp"))
        if model is not None:
            sync_grads(model.parameters(), groups.group("llm", "dp_cp"))
        busy, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
        if model is not None and model.stage.last:
            dist.all_reduce(loss, group=groups.group("llm", "dp_cp"))
        if it >= args.warmup:
            records.append((busy, wall, float(loss)))
            per_micro.append((list(fwd), list(bwd)))
            if step is not None:
                phases.append([getattr(times, k) for k in PHASES])
    dist.barrier()
    dist.destroy_process_group()
    here = np.zeros(0, np.int64)  # image-row ids this rank needs over the step (minimum bytes)
    if island:
        here = needed
    elif name == "heterogeneous" and model is not None and model.stage.first:
        offset = row_offsets(samples)
        here = np.concatenate([dst_keys(mb, samples, offset) for mb in mine.micro_batches])
    return dict(records=records, per_micro=per_micro, phases=phases, stage=stage_id,
                last_llm=model is not None and model.stage.last, images=images,
                route=(counter.forward, counter.backward),
                flops=encoder_flops(cfg.vision, hidden, images) / (vis.tp if encoder is not None else 1),
                dst_keys=here,
                micro_batches=num_micro if model is not None else 0)
