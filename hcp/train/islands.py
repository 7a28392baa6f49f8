"""Training under placement=non_colocated: each rank builds and runs only its island's modules,
and one step runs the graph-aware 1F1B across the islands (DESIGN.md 4.4).

The world is cut into islands (`hcp.config.layouts`): an encoder island runs the encoder (a ViT)
with its projector under the encoder's own TP, DP and PP (`hcp.model.encoder_stage`: blocks
split over the stages, the projector on the last), the LLM island runs the LLM stages. The step
plan (`hcp.plan.step`) gives every encoder lane one micro-batch per LLM micro-batch, in the
order the LLM consumes them, and a routing table per micro-batch from the encoder's last stage
to the LLM's first stage (destination CP: rows go to the CP rank holding their positions;
destination TP: the TP leader receives and broadcasts). Only encoder ranks read images (their
first stage), only LLM ranks read text (first stage; labels on the last).

The step (`IslandTrainer.forward_backward`): the module graph (`graph.edges`, modules on a
shared island folded into its head) becomes a stage graph (`hcp.schedule.graph`): an encoder
island's stages run before the LLM's first stage, the warm-up depth follows the longest path,
and each stage runs its action list (`hcp.schedule.graph_executor`): an encoder backward of
micro-batch i runs when its gradient arrives. All point-to-point ops of one schedule step go
out in one `batch_isend_irecv` on the world group (pipeline links and island routes alike;
NCCL needs one group per batch), and every rank of the LLM runs every micro-batch (empty ones
included), so each island's ranks post the same sequence of ops and collectives.

Then: gradients summed over each module's own DP (x CP) group, the clipping norm global over
every module and rank (each module's squared norm, reduced over its TP and PP groups, enters one
world all-reduce from the module's lowest rank), one optimizer step for all modules, the loss
and counts from the plan (the loss is shared with every rank by one world broadcast from the
logging rank, the lowest rank of the LLM's last stage, so every rank takes the same
non-finite decision). Checkpoints: each rank saves its own modules under their FQNs.

Evaluation: the encoder island sends its whole weights to the LLM's first stage, which then
evaluates as under colocation (`IslandTrainer.evaluate`).

Not built yet (refused in `hcp.train.support`): several encoder islands (joins, branches) in
the trainer, FSDP (`dp_shard`), encoder recompute and encoder CP, `packing=dynamic_cp`.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from hcp.comm.boundary import RouteBytes
from hcp.comm.island import IslandEdge
from hcp.model import init_parameters
from hcp.model.encoder_stage import EncoderStage
from hcp.model.stage import StageSpec
from hcp.parallel.grid import Grid
from hcp.parallel.islands import edge_ranks
from hcp.parallel.roles import logging_rank
from hcp.plan.step import island_head
from hcp.schedule.graph import graph_one_f_one_b, stage_graph
from hcp.schedule.graph_executor import GraphStageExecutor, PipeLink, RouteLink
from hcp.train.modules import clip_, module_sq_norm, sync_grads, whole_state
from hcp.train.trainer import Trainer


class IslandModules(nn.Module):
    """This rank's modules under one root whose names are the single-process model's
    (`vision.*`, `projector.*`, `llm.*`): an encoder stage's encoder and projector, or the
    LLM stage's `llm`. `layout_label` names the whole run's islands (checkpoint metadata)."""

    def __init__(self, encoder: EncoderStage | None, model, label: str):
        super().__init__()
        if encoder is not None:
            setattr(self, encoder.name, encoder.encoder)
            projector = getattr(encoder, encoder.projector_name, None)
            if projector is not None:
                setattr(self, encoder.projector_name, projector)
        if model is not None:
            self.llm = model.llm
        self.layout_label = label


def islands_label(layouts: dict, heads) -> str:
    """e.g. `vision dp2 on ranks 0-1 | llm tp2 on ranks 2-3`."""
    parts = []
    for m in [*heads, "llm"]:
        lay = layouts[m]
        sizes = " x ".join(f"{k}{getattr(lay, k)}" for k in ("tp", "cp", "pp", "dp") if getattr(lay, k) > 1)
        parts.append(f"{m} {sizes or '1 rank'} on ranks {lay.rank_offset}-{lay.rank_offset + lay.num_ranks - 1}")
    return " | ".join(parts)


class IslandTrainer(Trainer):
    """The trainer of one rank under placement=non_colocated (module docstring). Built by
    `Trainer(cfg, run_dir)`; the colocated parts (`prepare` on LLM ranks, the LLM's stage
    runner and gradient sync, checkpoints, logging) are the base class's."""

    # ---- which island this rank is on -------------------------------------------------
    def _island(self):
        """(this rank's island head module, its stage, the head of every encoder island)."""
        layouts = self.layouts
        heads = tuple(dict.fromkeys(island_head(layouts, self.edges, m) for m in layouts if m != "llm"))
        mine = next((h for h in heads if Grid.of(layouts[h]).contains(self.rank)), "llm")
        lay = layouts[mine]
        stage = StageSpec.of(lay.pp_layers, Grid.of(lay).coords(self.rank)["pp"])
        return mine, stage, heads

    def _build_encoder(self) -> EncoderStage | None:
        """This rank's encoder stage (encoder island), else None."""
        cfg, layouts = self.cfg, self.layouts
        self.head, self.island_stage, self.heads = self._island()
        if self.head == "llm":
            return None
        head, projector = self.head, self._projector_name()
        tp = self.groups.group(head, "tp") if layouts[head].tp > 1 else None
        torch.manual_seed(cfg.seed)
        encoder = EncoderStage(head, cfg[head], cfg[projector] if projector in layouts else None,
                               cfg.llm.hidden_size, self.island_stage, tp, projector)
        init_parameters(encoder, cfg.seed)
        for name in (head, projector):
            if name in layouts and cfg[name].freeze and getattr(encoder, name, None) is not None:
                getattr(encoder, name).requires_grad_(False)
        return encoder.to(self.device)

    def _build_model(self):
        return super()._build_model() if self.head == "llm" else None

    def _rank_modules(self) -> IslandModules:
        return IslandModules(self.encoder, self.model, islands_label(self.layouts, self.heads))

    def _tp_groups(self):
        groups = {"llm": self.tp_group}
        if self.encoder is not None:
            groups = {m: self.encoder.tp_group for m in (self.encoder.name, self.encoder.projector_name)}
        return groups if any(g is not None for g in groups.values()) else None

    # ---- data ---------------------------------------------------------------------------
    def prepare(self, indices):
        """LLM ranks: the base class's (text and metadata of every micro-batch, empty ones
        included). Encoder ranks: (RankPlan, per encoder micro-batch the pixel values of its
        samples' images [I, C, H, W] (first stage) or its image count (later stages), None,
        None, {})."""
        if self.encoder is None:
            return super().prepare(indices)
        step = self.plan(indices)
        mine = step.rank(self.rank, bool(self.cfg.trainer.get("check_plan")))
        per_micro = mine.encoder_micro_batches[self.head]
        if not self.island_stage.first:
            return mine, [int(step.sizes.images[list(mb)].sum()) for mb in per_micro], None, None, {}
        ds, enc = self.train_set, self.cfg[self.head]
        empty = torch.empty(0, enc.num_channels, enc.image_size, enc.image_size)
        pixels = [torch.cat([empty, *(ds.pixel_values(ds[indices[s]]) for s in mb)]).to(self.device)
                  for mb in per_micro]
        return mine, pixels, None, None, {}

    # ---- the step -------------------------------------------------------------------------
    def _autocast(self):
        if self.cfg.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _route_links(self, mine, graph) -> dict:
        """{peer global stage: RouteLink} of every island edge this rank is on; the bytes this
        rank sends over them accumulate in `self.route_bytes` (forward rows, returned gradients;
        the TP leader's broadcast inside the LLM island not counted)."""
        links, llm = {}, self.layouts["llm"]
        if not hasattr(self, "route_bytes"):
            self.route_bytes = RouteBytes()
        for edge, routes in mine.island_routes.items():
            src = island_head(self.layouts, self.edges, edge[0])
            ranks = edge_ranks(Grid.of(self.layouts[src]), Grid.of(llm))
            link_edge = IslandEdge(ranks, ranks.index(self.rank))
            hidden = self.cfg.llm.hidden_size
            if self.encoder is not None:
                links[graph.index("llm", 0)] = RouteLink(link_edge, routes, hidden, torch.float32,
                                                         self.device, self.route_bytes)
                continue
            leader = None
            if llm.tp > 1:  # the plan's default `leader` route: TP rank 0 receives, broadcasts
                rows = [mb.image_rows[1] - mb.image_rows[0] for mb in mine.micro_batches]
                leader = (self.tp_group, self.groups.ranks("llm", "tp")[0], rows)
            peer = graph.index(src, self.layouts[src].pp - 1)
            links[peer] = RouteLink(link_edge, routes, hidden, torch.float32, self.device,
                                    self.route_bytes, leader=leader)
        return links

    def _pipe_links(self, module: str, stage: StageSpec, g: int, spec) -> dict:
        """{peer global stage: PipeLink} to this rank's neighbours in its module's pipeline."""
        grid = Grid.of(self.layouts[module])
        c = grid.coords(self.rank)
        links = {}
        for step, ok in ((-1, not stage.first), (1, not stage.last)):
            if ok:
                peer = grid.rank_at(c["tp"], c["cp"], c["dp"], c["pp"] + step)
                links[g + step] = PipeLink(peer, spec, device=self.device)
        return links

    def forward_backward(self, global_batch: list[int], prepared=None) -> tuple[float, list[float], int]:
        """As `Trainer.forward_backward`, over the islands: returns (global loss, [global loss
        tokens, global tokens, global sum of squared document lengths], micro-batches)."""
        mine, inputs, batches, metas, _ = prepared if prepared is not None else self.prepare(global_batch)
        depths = {m: self.layouts[m].pp for m in (*self.heads, "llm")}
        heads = [(island_head(self.layouts, self.edges, a), island_head(self.layouts, self.edges, b))
                 for a, b in self.edges]
        graph = stage_graph(depths, list(dict.fromkeys(e for e in heads if e[0] != e[1])))
        links = self._route_links(mine, graph)
        c = mine.counts
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.encoder is None:
            stage, g = self.stage, graph.index("llm", self.stage.index)
            n_micro = len(mine.micro_batches)
            links.update(self._pipe_links("llm", stage, g, lambda i: self.runner._act_spec(metas[i])))
            producers = [p for p in links if p < g and graph.stages[p][0] != "llm"]

            def forward(i, received):
                nonlocal loss_total
                if stage.first:
                    _, batch = batches[i]
                    rows = [received[p] for p in producers]
                    batch.image_rows = rows[0] if rows else None
                    out = self.runner._stage(batch, None)
                else:
                    out = self.runner._stage(metas[i], received[g - 1])
                if not stage.last:
                    return out
                loss_total = loss_total + out[0].detach().double()
                return out[0].float() / c.loss_tokens
        else:
            stage, g = self.island_stage, graph.index(self.head, self.island_stage.index)
            n_micro = len(inputs)
            images = ([int(x.shape[0]) for x in inputs] if stage.first else inputs)
            links.update(self._pipe_links(self.head, stage, g, lambda i: (
                self.encoder.activation_shape(images[i]), torch.float32)))

            def forward(i, received):
                with self._autocast():
                    out = self.encoder(inputs[i] if stage.first else received[g - 1])
                return out.float()
        reducer = self.runner.reducer if self.runner is not None else None
        executor = GraphStageExecutor(forward, links, reducer.sync_in_backward if reducer else None)
        self.stage_times = executor.run(graph_one_f_one_b(graph, n_micro)[g])
        self._sync(mine)
        if self.encoder is None and stage.last:
            dist.all_reduce(loss_total, group=self.grad_group)
        dist.broadcast(loss_total, logging_rank(self.layouts))  # every rank: the same loss (non-finite guard)
        return loss_total.item() / c.loss_tokens, [float(c.loss_tokens), float(c.tokens), c.sum_sq_lengths], n_micro

    def _sync(self, mine) -> None:
        """Each module's gradients summed over its own DP (x CP) group."""
        if self.encoder is None:  # the LLM's DP x CP sum (buckets launched in the last backward)
            self.runner.sync_grads()
            return
        params = list(self.encoder.parameters())
        self.encoder_grad_sq = sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None)
        sync_grads(params, self.groups.group(self.head, "dp"))
        if mine.counts.image_rows == 0:  # no image anywhere: as in one process, no encoder update
            for p in params:
                p.grad = None

    def clip(self, max_norm: float) -> float:
        """Clip every module's gradients by their global L2 norm over all islands; return it.
        Each module's squared norm (over its TP and PP groups) enters one world all-reduce from
        the module's lowest rank."""
        modules = (*self.heads, "llm")
        sq = torch.zeros(len(modules), dtype=torch.float64, device=self.device)
        module = self.head
        lay = self.layouts[module]
        own = self.encoder if self.encoder is not None else self.model
        tp = self.encoder.tp_group if self.encoder is not None else self.tp_group
        pp = self.groups.group(module, "pp") if lay.pp > 1 else None
        part = module_sq_norm(own.parameters(), self.device, tp, None, pp)
        if self.rank == lay.rank_offset:
            sq[modules.index(module)] = part
        dist.all_reduce(sq)
        norm = float(sq.sum().sqrt())
        clip_(self.modules.parameters(), norm, max_norm)
        return norm

    def evaluate(self) -> dict:
        """Held-out evaluation: greedy decoding re-encodes each prompt's images inside the LLM's
        first stage, so the encoder island first sends its whole weights there
        (`_island_encoder`, a collective over the island heads and the LLM's first stage); then
        the LLM island evaluates as under colocation and the encoder ranks return {}."""
        if self.eval_set is None:
            return {}
        whole = self._island_encoder()
        if self.model is None:
            return {}
        self._whole = whole
        return super().evaluate()

    def _whole_encoder(self):
        return getattr(self, "_whole", None)

    def _island_encoder(self) -> EncoderStage | None:
        """The encoder and projector whole on the LLM's first-stage ranks (None elsewhere): each
        encoder stage gathers its TP shards (lane 0 sends), then one broadcast per stage over a
        group of those senders and the LLM's first stage; shapes come from the config."""
        cfg, lay, head = self.cfg, self.layouts[self.heads[0]], self.heads[0]
        grid = Grid.of(lay)
        senders = [grid.rank_at(pp=s) for s in range(lay.pp)]
        members = sorted({*senders, *(int(r) for r in Grid.of(self.layouts["llm"]).ranks[0].ravel())})
        if getattr(self, "_eval_group", None) is None:
            self._eval_group = dist.new_group(members)  # every rank calls new_group
        state = {}
        if self.encoder is not None:  # TP shards gathered (a collective over the TP group)
            state = (whole_state(self.encoder, self.encoder.tp_group)
                     or {n: p.detach() for n, p in self.encoder.named_parameters()})
        if self.rank not in members:
            return None
        projector = self._projector_name()
        proj_cfg = cfg[projector] if projector in self.layouts else None

        def stage(spec, device="meta"):
            with torch.device(device):
                return EncoderStage(head, cfg[head], proj_cfg, cfg.llm.hidden_size, spec, None, projector)
        received = {}
        for s, src in enumerate(senders):
            shapes = [(n, p.shape) for n, p in stage(StageSpec.of(lay.pp_layers, s)).named_parameters()]
            flat = (torch.cat([state[n].flatten() for n, _ in shapes]) if self.rank == src else
                    torch.empty(sum(shape.numel() for _, shape in shapes), device=self.device))
            dist.broadcast(flat, src, group=self._eval_group)
            for (n, shape), t in zip(shapes, flat.split([shape.numel() for _, shape in shapes])):
                received[n] = t.view(shape)
        if self.model is None or not self.stage.first:
            return None
        whole = stage(StageSpec.whole(sum(lay.pp_layers)), self.device)
        whole.load_state_dict(received, assign=True)
        return whole

    def _projector_name(self) -> str:
        """The module sharing the encoder's island (LLaVA's projector; `projector` if none)."""
        members = [m for m in self.layouts if m not in (self.heads[0], "llm")
                   and island_head(self.layouts, self.edges, m) == self.heads[0]]
        return members[0] if members else "projector"

