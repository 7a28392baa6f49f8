"""Training under placement=non_colocated (docs/design.md 4.4): each rank builds and runs only its
island's modules, and one step is the graph-aware 1F1B across the islands. `Islands` is the
placement's runtime that `hcp.train.trainer.Trainer` composes (it never imports the trainer).

Each encoder island runs one encoder (with its projectors) under its own TP/CP/DP/PP
(`hcp.model.encoder_stage`); the LLM island runs the LLM stages. The step plan gives every
encoder lane one micro-batch per LLM micro-batch and per stream a route to the CP rank holding
each row (`hcp.plan.island_routes`). All point-to-point ops of one schedule step go out in one
`batch_isend_irecv` on one dedicated all-rank group, and every LLM rank runs every micro-batch
(empty ones too), so each island's ranks post the same ops and collectives. Routes and links
carry the compute dtype. Then: per-module DP (x CP) gradient sums, one global clipping norm,
one optimizer step; the loss goes to every rank by one world broadcast from the logging rank.
Evaluation lends every encoder's whole weights to the LLM's first stage (`Islands.whole_encoders`).
Refused in `hcp.train.support`: selective encoder recompute, a projector on its own island (or
unlike its encoder), a fully frozen island."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from hcp.comm.boundary import RouteBytes
from hcp.comm.island import IslandEdge, warm_up
from hcp.model.encoder_stage import EncoderStage
from hcp.model.init import meta_build
from hcp.model.llava import OWN_CP_GROUP
from hcp.model.stage import StageSpec
from hcp.parallel.grid import Grid
from hcp.parallel.groups import new_group
from hcp.parallel.upload import upload
from hcp.parallel.islands import edge_ranks
from hcp.parallel.roles import logging_rank
from hcp.plan.actions import island_heads, island_stage_graph
from hcp.plan.step import island_head
from hcp.schedule.executor import BusyClock, Executor
from hcp.schedule.links import PipeLink, RouteLink, StreamsLink
from hcp.train.fsdp import grad_sync as fsdp_grad_sync
from hcp.train.island_eval import whole_island_encoders
from hcp.train.modules import clip_, local_grad_sq, module_sq_norm, sync_grads


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
        sizes = " x ".join(f"{k}{getattr(lay, k)}" for k in ("tp", "cp", "pp", "dp")
                           if getattr(lay, k) > 1)
        parts.append(f"{m} {sizes or '1 rank'} on ranks "
                     f"{lay.rank_offset}-{lay.rank_offset + lay.num_ranks - 1}")
    return " | ".join(parts)


class Islands:
    """This rank's runtime under placement=non_colocated (module docstring): which island it is
    on, its encoder stage, its data, the step across the islands, the clipping norm and the
    whole encoders for evaluation. Pure until `connect`.

    Args:
        specs: the run's `hcp.config.specs.ModuleSpecs` (with layouts); groups: the
            `ProcessGroupRegistry`; rank: this global rank; device; precision: the run's
            `Precision`; fsdp_reduce: `trainer.fsdp_reduce`.

    Attributes: `head` (this rank's island head module, "llm" on the LLM island), `stage` (its
    `StageSpec` there), `heads` (every encoder island's head), `streams` (island head -> its
    projectors into the LLM, in stream order: the order its rows are concatenated in),
    `sharded` (this island shards with FSDP: an encoder island by its encoder's
    `layout.dp_shard`, over its DP x CP group; the LLM island by `llm.layout.dp_shard`, over DP x
    CP; when it reduce-scatters: `fsdp_reduce`, `trainer.fsdp_reduce`), `route_bytes` (what this
    rank sends over island routes: forward rows, returned gradients; the TP leader's broadcast
    inside the LLM island not counted).
    """

    def __init__(self, specs, groups, rank: int, device, precision,
                 fsdp_reduce: str = "per_micro_batch"):
        self.specs, self.groups, self.rank = specs, groups, rank
        self.fsdp_reduce = fsdp_reduce
        self.layouts = layouts = specs.layouts
        self.device, self.precision = device, precision
        self.edges = specs.edges
        self.heads = island_heads(layouts, self.edges)
        self.head = next((h for h in self.heads if Grid.of(layouts[h]).contains(rank)), "llm")
        lay = layouts[self.head]
        self.stage = StageSpec.of(lay.pp_layers, Grid.of(lay).coords(rank)["pp"])
        self.streams = {h: tuple(s.projector for s in specs.streams
                                 if island_head(layouts, self.edges, s.projector) == h)
                        for h in self.heads}
        self.sharded = bool(lay.dp_shard)
        self.route_bytes = RouteBytes()
        self.p2p_group = None
        self.eval_groups = None  # hcp.train.island_eval: made on the first evaluation

    def connect(self, world: int) -> None:
        """Every rank, in the same order: the one group all schedule P2P ops are posted on."""
        self.p2p_group = new_group(range(world))
        warm_up(IslandEdge(tuple(range(world)), self.rank, self.p2p_group), self.device)

    # ---- modules --------------------------------------------------------------------------
    def build_encoder(self) -> EncoderStage | None:
        """This rank's encoder stage on the meta device (encoder island), else None."""
        specs, layouts, head = self.specs, self.layouts, self.head
        if head == "llm":
            return None
        tp = self.groups.group(head, "tp") if layouts[head].tp > 1 else None
        cp = self.groups.group(head, "cp") if layouts[head].cp > 1 else None
        projectors = {p: specs[p].arch for p in self.streams[head]}
        with meta_build():  # the trainer materializes this rank's shards
            encoder = EncoderStage(head, specs[head].arch, projectors, specs.llm.hidden_size,
                                   self.stage, tp, layouts[head].recompute == "full", cp)
        for name in (head, *projectors):
            if specs[name].freeze and getattr(encoder, name, None) is not None:
                getattr(encoder, name).requires_grad_(False)
        return encoder

    def modules(self, encoder, model) -> IslandModules:
        """This rank's modules under one root (checkpoints, optimizer)."""
        return IslandModules(encoder, model, islands_label(self.layouts, self.heads))

    @staticmethod
    def tp_groups(encoder, llm_tp):
        """TP group of each of this rank's modules (checkpoints); None without TP."""
        groups = {"llm": llm_tp}
        if encoder is not None:
            groups = {m: encoder.tp_group for m in (encoder.name, *encoder.projector_names)}
        return groups if any(g is not None for g in groups.values()) else None

    # ---- data ---------------------------------------------------------------------------
    def encoder_inputs(self, mine, indices, dataset):
        """An encoder rank's inputs of the step: per encoder micro-batch the inputs of its
        samples [I, C, H, W] (first stage) or its input count (later stages).

        Raises RuntimeError when the data and the plan disagree on a micro-batch's inputs."""
        head = self.head
        counts = mine.encoder_inputs[head]
        if not self.stage.first:
            return list(counts)
        enc = self.specs[head].arch
        empty = torch.empty(0, enc.num_channels, enc.image_size, enc.image_size)
        pixels = [upload(torch.cat([empty, *(dataset.pixel_values(dataset[indices[s]], head)
                                             for s in mb)]),
                         self.device)
                  for mb in mine.encoder_micro_batches[head]]
        read = [int(x.shape[0]) for x in pixels]
        if read != list(counts):
            raise RuntimeError(f"step plan and data disagree on {head}'s inputs per micro-batch: "
                               f"{list(counts)} planned, {read} read (a stale length index)")
        return pixels

    # ---- the step -------------------------------------------------------------------------
    def _stage_graph(self):
        """The stage graph of the islands (`hcp.plan.actions.island_stage_graph`)."""
        return island_stage_graph(self.layouts, self.edges)

    def _route_links(self, mine, graph, encoder_rank: bool) -> dict:
        """{peer global stage: StreamsLink} of every island edge this rank is on (one link per
        encoder island, its streams in stream order)."""
        links, llm, hidden = {}, self.layouts["llm"], self.specs.llm.hidden_size
        for head in self.heads:
            flows = [p for p in self.streams[head] if (p, "llm") in mine.island_routes]
            if not flows:
                continue
            ranks = edge_ranks(Grid.of(self.layouts[head]), Grid.of(llm))
            edge = IslandEdge(ranks, ranks.index(self.rank), self.p2p_group)
            if encoder_rank:  # source: the rows this lane computes per stream
                rows = [mine.encoder_rows[p] for p in flows]
                peer = graph.index("llm", 0)
            else:             # destination: the rows of this rank's shard
                rows = [[mb.stream_rows[p][1] - mb.stream_rows[p][0] for mb in mine.micro_batches]
                        for p in flows]
                peer = graph.index(head, self.layouts[head].pp - 1)
            routes = []
            for p, r in zip(flows, rows):
                leader = None  # the plan's default `leader` route: TP rank 0 receives, broadcasts
                if not encoder_rank and llm.tp > 1:
                    leader = (self.groups.group("llm", "tp"), self.groups.ranks("llm", "tp")[0], r)
                routes.append(RouteLink(edge, mine.island_routes[(p, "llm")], hidden,
                                        self.precision.compute, self.device, self.route_bytes,
                                        leader=leader))
            links[peer] = StreamsLink(routes, rows)
        return links

    def _pipe_links(self, g: int, spec) -> dict:
        """{peer global stage: PipeLink} to this rank's neighbours in its module's pipeline."""
        grid = Grid.of(self.layouts[self.head])
        c = grid.coords(self.rank)
        links = {}
        for step, ok in ((-1, not self.stage.first), (1, not self.stage.last)):
            if ok:
                peer = grid.rank_at(c["tp"], c["cp"], c["dp"], c["pp"] + step)
                links[g + step] = PipeLink(peer, spec, self.p2p_group, self.device)
        return links

    def forward_backward(self, mine, inputs, batches, metas, encoder, runner,
                         record_grad_sq: bool = False, cp_groups=None):
        """One step across the islands on this rank: gradients of the token-level loss summed
        over each module's DP (x CP) group. inputs: `encoder_inputs` (encoder ranks); batches,
        metas: the LLM's micro-batches (first stage: (plan, batch) pairs) and `StageMeta`s (LLM
        ranks); encoder: this rank's `EncoderStage` or None; runner: the LLM's
        `hcp.train.step.StepRunner` or None; cp_groups: under `packing=dynamic_cp` the CP group
        of each LLM micro-batch (the plan's, pre-built; None at CP size 1), else None: the
        LLM's own. Returns (global loss, [global loss tokens, global
        tokens, global sum of squared document lengths], micro-batches, `StageTimes`, this
        rank's encoder gradients' sum of squares before their DP sum or None)."""
        graph = self._stage_graph()
        links = self._route_links(mine, graph, encoder is not None)
        c = mine.counts
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        stage, prec = self.stage, self.precision
        g = graph.index(self.head, stage.index)
        if encoder is None:
            n_micro = len(mine.micro_batches)
            cps = cp_groups if cp_groups is not None else [OWN_CP_GROUP] * n_micro
            links.update(self._pipe_links(g, lambda i: runner.act_spec(metas[i], cps[i])))
            producers = {p: self.streams[graph.stages[p][0]] for p in graph.prev[g]
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
                    out = runner.stage_forward(batch, None, cp_group=cps[i])
                else:
                    out = runner.stage_forward(metas[i], received[g - 1], cp_group=cps[i])
                if not stage.last:
                    return out
                loss_total = loss_total + out[0].detach().double()
                return out[0].float() / c.loss_tokens
        else:
            n_micro = len(inputs)
            images = list(mine.encoder_inputs[self.head])
            links.update(self._pipe_links(g, lambda i: (encoder.activation_shape(images[i]),
                                                        prec.compute)))

            def forward(i, received):  # in the compute dtype out, widened in (as the LLM's stages)
                return prec.stage_forward(self.device.type,
                                          lambda h: encoder(inputs[i] if h is None else h),
                                          None if stage.first else received[g - 1])
        reducer = runner.reducer if runner is not None else None
        grad_sync = reducer.sync_in_backward if reducer and mine.overlap_grad_sync else None
        if self.sharded:  # FSDP: reduce-scatter per trainer.fsdp_reduce
            own = encoder if encoder is not None else runner.model
            grad_sync = fsdp_grad_sync(own, self.fsdp_reduce)
        executor = Executor(forward, links, grad_sync, BusyClock(self.device, time.thread_time))
        times = executor.run(mine.actions)  # the plan's: graph 1F1B, SyncGrads where it overlaps
        grad_sq = self._sync(mine, encoder, runner, record_grad_sq)
        if encoder is None and stage.last:
            dist.all_reduce(loss_total, group=self.groups.group("llm", "dp_cp"))
        # every rank: the same loss (non-finite guard)
        dist.broadcast(loss_total, logging_rank(self.layouts))
        counts = [float(c.loss_tokens), float(c.tokens), c.sum_sq_lengths]
        return loss_total / c.loss_tokens, counts, n_micro, times, grad_sq

    def _sync(self, mine, encoder, runner, record_grad_sq: bool):
        """Each module's gradients summed over its own DP (x CP) group; returns this rank's
        encoder gradients' sum of squares before the sum when `record_grad_sq`, else None."""
        if encoder is None:  # the LLM's DP x CP sum (buckets launched in the last backward)
            runner.sync_grads()
            return None
        params = list(encoder.parameters())
        grad_sq = local_grad_sq(params) if record_grad_sq else None
        sync_grads(params, self.groups.group(self.head, "dp_cp"))  # FSDP shards: already reduced
        if sum(mine.counts.stream_rows.get(p, 0) for p in self.streams[self.head]) == 0:
            for p in params:  # no input of this encoder anywhere: as in one process, no update
                p.grad = None
        return grad_sq

    def clip(self, own: nn.Module, tp_group, params, max_norm: float) -> torch.Tensor:
        """Clip every module's gradients by their global L2 norm over all islands; return it.
        own: this rank's module (its encoder stage or LLM stage); tp_group: its TP group;
        params: every parameter of this rank. Each island's squared norm (over its TP and PP
        groups) enters one world all-reduce from the island's lowest rank; the norm is a 0-d
        device tensor."""
        modules = (*self.heads, "llm")
        sq = torch.zeros(len(modules), dtype=torch.float64, device=self.device)
        module, lay = self.head, self.layouts[self.head]
        pp = self.groups.group(module, "pp") if lay.pp > 1 else None
        shards = (None if not self.sharded else self.groups.group("llm", "dp_cp") if module == "llm"
                  else self.groups.group(module, "dp_cp"))
        part = module_sq_norm(own.parameters(), self.device, tp_group, shards, pp)
        if self.rank == lay.rank_offset:
            sq[modules.index(module)] = part
        dist.all_reduce(sq)
        norm = sq.sum().sqrt()
        clip_(params, norm, max_norm)
        return norm

    def whole_encoders(self, encoder):
        """Every encoder island's weights whole on the LLM's first stage (None elsewhere), for
        evaluation (`hcp.train.island_eval.whole_island_encoders`; a collective of every rank)."""
        return whole_island_encoders(self, encoder)
