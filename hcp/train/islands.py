"""Training under placement=non_colocated: each rank builds and runs only its island's modules,
and one step runs the graph-aware 1F1B across the islands (docs/design.md 4.4).

The world is cut into islands (`hcp.config.layouts`): each encoder island runs one encoder (a
ViT) with its projector(s) under the encoder's own TP, DP and PP (`hcp.model.encoder_stage`:
blocks split over the stages, the projectors on the last), the LLM island runs the LLM stages.
Several encoders (`encoders.<name>`, `hcp.config.modules`) each get their own island: a join
(two encoder islands feeding the LLM's first stage) or a branch (one island whose tower feeds
two projectors, each a stream of rows into the LLM; the tower runs once and its gradient is
the sum of both). The step plan (`hcp.plan.step`) gives every encoder lane one micro-batch per
LLM micro-batch, in the order the LLM consumes them, and per stream a routing table per
micro-batch from its encoder's last stage to the LLM's first stage (destination CP: rows go to
the CP rank holding their positions; destination TP: the TP leader receives and broadcasts);
an island's streams travel as one link (`StreamsLink`), cut by the plan's row counts. Only
encoder ranks read their encoder's inputs (first stage), only LLM ranks read text (first
stage; labels on the last).

The step (`IslandTrainer.forward_backward`): the module graph (`graph.edges`, modules on a
shared island folded into its head) becomes a stage graph (`hcp.schedule.graph`): an encoder
island's stages run before the LLM's first stage, the warm-up depth follows the longest path,
and each stage runs its action list (`hcp.schedule.graph_executor`): an encoder backward of
micro-batch i runs when its gradient arrives. All point-to-point ops of one schedule step go
out in one `batch_isend_irecv` on one dedicated group over all ranks (pipeline links and
island routes alike; NCCL needs one group per batch; kept apart from the world group's
collectives), and every rank of the LLM runs every micro-batch (empty ones included), so each
island's ranks post the same sequence of ops and collectives.

Precision (`hcp.config.precision.Precision`, the colocated schedule's too): every island's
forward runs under the run's autocast; island routes and pipeline links carry activations and
their gradients in the compute dtype, and a received residual stream is widened back to fp32.

Then: gradients summed over each module's own DP (x CP) group, the clipping norm global over
every module and rank (each module's squared norm, reduced over its TP and PP groups, enters one
world all-reduce from the module's lowest rank), one optimizer step for all modules, the loss
and counts from the plan (the loss is shared with every rank by one world broadcast from the
logging rank, the lowest rank of the LLM's last stage, so every rank takes the same
non-finite decision). Checkpoints: each rank saves its own modules under their FQNs.

Evaluation: every encoder island sends its whole weights to the LLM's first stage, which then
evaluates as under colocation (`IslandTrainer.evaluate`, `hcp.train.island_eval`).

Encoder recompute (`<encoder>.layout.recompute=full`, its projectors follow): each ViT block
of the island keeps only its input per micro-batch in flight and runs its forward again in its
backward (`hcp.model.vit.ViTEncoder`'s `recompute`; TP collectives of the recompute run on every
TP rank at the same schedule step), as plan mode's memory estimate assumes.

FSDP (`<encoder>.layout.dp_shard=true`, its projectors follow; `llm.layout.dp_shard=true`):
an encoder island's stage shards over its DP x CP group (`hcp.train.fsdp.shard_island`), the LLM's
over its DP x CP group; each reduce-scatters once per step (gradient sync on for the last
backward only).

Encoder CP (`<encoder>.layout.cp`): every input's tokens split over the island's CP ranks
(`hcp.model.vit`); the routes take each row from the CP rank that holds it (`hcp.plan.island_routes`).

Not built yet (refused in `hcp.train.support`): selective encoder recompute,
`packing=dynamic_cp`, a projector on an island of its own (or with a recompute or dp_shard
other than its encoder's), a fully frozen island.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hcp.comm.boundary import RouteBytes
from hcp.comm.island import IslandEdge, warm_up
from hcp.config.modules import module_cfg, streams
from hcp.model.encoder_stage import EncoderStage
from hcp.model.stage import StageSpec
from hcp.parallel.grid import Grid
from hcp.parallel.islands import edge_ranks
from hcp.parallel.roles import logging_rank
from hcp.plan.step import island_head
from hcp.schedule.graph import graph_one_f_one_b, stage_graph
from hcp.schedule.graph_executor import GraphStageExecutor, PipeLink, RouteLink, StreamsLink
from hcp.train.island_eval import whole_island_encoders
from hcp.train.modules import clip_, local_grad_sq, module_sq_norm, sync_grads
from hcp.train.trainer import Trainer


class IslandModules(nn.Module):
    """This rank's modules under one root whose names are the single-process model's
    (`vision.*`, `projector.*`, `vision2.*`, `llm.*`): an encoder stage's encoder and
    projectors, or the LLM stage's `llm`. `layout_label` names the whole run's islands
    (checkpoint metadata)."""

    def __init__(self, encoder: EncoderStage | None, model, label: str):
        super().__init__()
        if encoder is not None:
            setattr(self, encoder.name, encoder.encoder)
            for p in encoder.projector_names:
                setattr(self, p, getattr(encoder, p))
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

    def __init__(self, cfg, run_dir: str):
        super().__init__(cfg, run_dir)
        # every rank, in the same order: the one group all schedule P2P ops are posted on
        self.p2p_group = dist.new_group(list(range(self.world)))
        warm_up(IslandEdge(tuple(range(self.world)), self.rank, self.p2p_group), self.device)

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
        """This rank's encoder stage (encoder island), else None. Sets `head`, `island_stage`,
        `heads` and `island_streams` (island head -> its projectors into the LLM, in stream
        order: the order its rows are concatenated in)."""
        cfg, layouts = self.cfg, self.layouts
        self.head, self.island_stage, self.heads = self._island()
        self.island_streams = {h: tuple(s.projector for s in streams(self.edges)
                                        if island_head(layouts, self.edges, s.projector) == h)
                               for h in self.heads}
        if self.head == "llm":
            return None
        head = self.head
        tp = self.groups.group(head, "tp") if layouts[head].tp > 1 else None
        cp = self.groups.group(head, "cp") if layouts[head].cp > 1 else None
        projectors = {p: module_cfg(cfg, p) for p in self.island_streams[head]}
        with torch.device("meta"):  # the base class materializes this rank's shards
            encoder = EncoderStage(head, module_cfg(cfg, head), projectors, cfg.llm.hidden_size,
                                   self.island_stage, tp, layouts[head].recompute == "full", cp)
        for name in (head, *projectors):
            if module_cfg(cfg, name).freeze and getattr(encoder, name, None) is not None:
                getattr(encoder, name).requires_grad_(False)
        return encoder

    def _build_model(self):
        return super()._build_model() if self.head == "llm" else None

    def _sharded(self) -> bool:
        """Whether this rank's island shards with FSDP: an encoder island by its encoder's
        `layout.dp_shard` (its projectors follow), over its DP x CP group; the LLM island by
        `llm.layout.dp_shard`, over its DP x CP group (both applied by the base class,
        `hcp.train.fsdp`)."""
        return bool(self.layouts[self.head].dp_shard)


    def _rank_modules(self) -> IslandModules:
        return IslandModules(self.encoder, self.model, islands_label(self.layouts, self.heads))

    def _tp_groups(self):
        groups = {"llm": self.tp_group}
        if self.encoder is not None:
            groups = {m: self.encoder.tp_group for m in (self.encoder.name, *self.encoder.projector_names)}
        return groups if any(g is not None for g in groups.values()) else None

    # ---- data ---------------------------------------------------------------------------
    def prepare(self, indices, step=None):
        """LLM ranks: the base class's (text and metadata of every micro-batch, empty ones
        included). Encoder ranks: (RankPlan, per encoder micro-batch the inputs of its
        samples [I, C, H, W] (first stage) or its input count (later stages), None, None, {}).

        Raises RuntimeError when the data and the plan disagree on a micro-batch's inputs."""
        if self.encoder is None:
            return super().prepare(indices, step)
        step = self.plan(indices) if step is None else step
        mine = step.rank(self.rank, bool(self.cfg.trainer.get("check_plan")))
        counts = mine.encoder_inputs[self.head]
        if not self.island_stage.first:
            return mine, list(counts), None, None, {}
        ds, enc, head = self.train_set, module_cfg(self.cfg, self.head), self.head
        empty = torch.empty(0, enc.num_channels, enc.image_size, enc.image_size)
        pixels = [torch.cat([empty, *(ds.pixel_values(ds[indices[s]], head) for s in mb)]).to(self.device)
                  for mb in mine.encoder_micro_batches[head]]
        read = [int(x.shape[0]) for x in pixels]
        if read != list(counts):
            raise RuntimeError(f"step plan and data disagree on {head}'s inputs per micro-batch: "
                               f"{list(counts)} planned, {read} read (a stale length index)")
        return mine, pixels, None, None, {}

    # ---- the step -------------------------------------------------------------------------
    def _stage_graph(self):
        """The stage graph of the islands: every island head's stages, then the LLM's."""
        depths = {m: self.layouts[m].pp for m in (*self.heads, "llm")}
        heads = [(island_head(self.layouts, self.edges, a), island_head(self.layouts, self.edges, b))
                 for a, b in self.edges]
        return stage_graph(depths, list(dict.fromkeys(e for e in heads if e[0] != e[1])))

    def _route_links(self, mine, graph) -> dict:
        """{peer global stage: StreamsLink} of every island edge this rank is on (one link per
        encoder island, its streams in stream order); the bytes this rank sends over them
        accumulate in `self.route_bytes` (forward rows, returned gradients; the TP leader's
        broadcast inside the LLM island not counted)."""
        links, llm, hidden = {}, self.layouts["llm"], self.cfg.llm.hidden_size
        if not hasattr(self, "route_bytes"):
            self.route_bytes = RouteBytes()
        for head in self.heads:
            flows = [p for p in self.island_streams[head] if (p, "llm") in mine.island_routes]
            if not flows:
                continue
            ranks = edge_ranks(Grid.of(self.layouts[head]), Grid.of(llm))
            edge = IslandEdge(ranks, ranks.index(self.rank), self.p2p_group)
            if self.encoder is not None:  # source: the rows this lane computes per stream
                rows = [mine.encoder_rows[p] for p in flows]
                peer = graph.index("llm", 0)
            else:                         # destination: the rows of this rank's shard
                rows = [[mb.stream_rows[p][1] - mb.stream_rows[p][0] for mb in mine.micro_batches]
                        for p in flows]
                peer = graph.index(head, self.layouts[head].pp - 1)
            routes = []
            for p, r in zip(flows, rows):
                leader = None  # the plan's default `leader` route: TP rank 0 receives, broadcasts
                if self.encoder is None and llm.tp > 1:
                    leader = (self.tp_group, self.groups.ranks("llm", "tp")[0], r)
                routes.append(RouteLink(edge, mine.island_routes[(p, "llm")], hidden, self.precision.compute,
                                        self.device, self.route_bytes, leader=leader))
            links[peer] = StreamsLink(routes, rows)
        return links

    def _pipe_links(self, module: str, stage: StageSpec, g: int, spec) -> dict:
        """{peer global stage: PipeLink} to this rank's neighbours in its module's pipeline."""
        grid = Grid.of(self.layouts[module])
        c = grid.coords(self.rank)
        links = {}
        for step, ok in ((-1, not stage.first), (1, not stage.last)):
            if ok:
                peer = grid.rank_at(c["tp"], c["cp"], c["dp"], c["pp"] + step)
                links[g + step] = PipeLink(peer, spec, self.p2p_group, self.device)
        return links

    def forward_backward(self, global_batch: list[int], prepared=None) -> tuple[float, list[float], int]:
        """As `Trainer.forward_backward`, over the islands: returns (global loss, [global loss
        tokens, global tokens, global sum of squared document lengths], micro-batches)."""
        mine, inputs, batches, metas, _ = prepared if prepared is not None else self.prepare(global_batch)
        graph = self._stage_graph()
        links = self._route_links(mine, graph)
        c = mine.counts
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.encoder is None:
            stage, g = self.stage, graph.index("llm", self.stage.index)
            n_micro = len(mine.micro_batches)
            links.update(self._pipe_links("llm", stage, g, lambda i: self.runner._act_spec(metas[i])))
            producers = {p: self.island_streams[graph.stages[p][0]] for p in graph.prev[g]
                         if graph.stages[p][0] != "llm"}

            def forward(i, received):
                nonlocal loss_total
                if stage.first:
                    mb, batch = batches[i]
                    rows = {}
                    for p, flows in producers.items():  # each island's rows, cut by stream
                        cut = [mb.stream_rows[f][1] - mb.stream_rows[f][0] for f in flows]
                        rows.update(zip(flows, received[p].split(cut)))
                    batch.image_rows, batch.stream_rows = rows.pop("projector", None), rows
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
            images = list(mine.encoder_inputs[self.head])
            links.update(self._pipe_links(self.head, stage, g, lambda i: (
                self.encoder.activation_shape(images[i]), self.precision.compute)))
            prec = self.precision

            def forward(i, received):  # in the compute dtype out, widened in (as the LLM's stages)
                return prec.stage_forward(self.device.type, lambda h: self.encoder(inputs[i] if h is None else h),
                                          None if stage.first else received[g - 1])
        reducer = self.runner.reducer if self.runner is not None else None
        grad_sync = reducer.sync_in_backward if reducer else None
        if self._sharded():  # FSDP: one reduce-scatter per step, in the last backward
            grad_sync = (self.encoder if self.encoder is not None else self.model).set_requires_gradient_sync
        executor = GraphStageExecutor(forward, links, grad_sync)
        self.stage_times = executor.run(graph_one_f_one_b(graph, n_micro)[g])
        self._sync(mine)
        if self.encoder is None and stage.last:
            dist.all_reduce(loss_total, group=self.grad_group)
        dist.broadcast(loss_total, logging_rank(self.layouts))  # every rank: the same loss (non-finite guard)
        return loss_total / c.loss_tokens, [float(c.loss_tokens), float(c.tokens), c.sum_sq_lengths], n_micro

    def _sync(self, mine) -> None:
        """Each module's gradients summed over its own DP (x CP) group."""
        if self.encoder is None:  # the LLM's DP x CP sum (buckets launched in the last backward)
            self.runner.sync_grads()
            return
        params = list(self.encoder.parameters())
        if self.record_encoder_grad_sq:
            self.encoder_grad_sq = local_grad_sq(params)
        sync_grads(params, self.groups.group(self.head, "dp_cp"))  # FSDP shards: already reduced
        if sum(mine.counts.stream_rows.get(p, 0) for p in self.island_streams[self.head]) == 0:
            for p in params:  # no input of this encoder anywhere: as in one process, no update
                p.grad = None

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip every module's gradients by their global L2 norm over all islands; return it.
        Each island's squared norm (over its TP and PP groups) enters one world all-reduce from
        the island's lowest rank."""
        modules = (*self.heads, "llm")
        sq = torch.zeros(len(modules), dtype=torch.float64, device=self.device)
        module = self.head
        lay = self.layouts[module]
        own = self.encoder if self.encoder is not None else self.model
        tp = self.encoder.tp_group if self.encoder is not None else self.tp_group
        pp = self.groups.group(module, "pp") if lay.pp > 1 else None
        shards = (None if not self._sharded() else self.grad_group if module == "llm"
                  else self.groups.group(module, "dp_cp"))
        part = module_sq_norm(own.parameters(), self.device, tp, shards, pp)
        if self.rank == lay.rank_offset:
            sq[modules.index(module)] = part
        dist.all_reduce(sq)
        norm = sq.sum().sqrt()
        clip_(self.modules.parameters(), norm, max_norm)
        return norm

    def evaluate(self) -> dict:
        """Held-out evaluation: greedy decoding re-encodes each prompt's inputs inside the LLM's
        first stage, so every encoder island first sends its whole weights there
        (`hcp.train.island_eval.whole_island_encoders`, collectives over each island's senders
        and the LLM's first stage); then the LLM island evaluates as under colocation and the
        encoder ranks return {}."""
        if self.eval_set is None:
            return {}
        whole = whole_island_encoders(self)
        if self.model is None:
            return {}
        self._whole = whole
        return super().evaluate()

    def _whole_encoder(self):
        return getattr(self, "_whole", None)
