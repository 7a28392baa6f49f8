"""The trainer's encoder side when the module graph has several encoders or streams (colocated
placement): named encoders and projectors (`hcp.config.modules`) built as one
`hcp.model.encoder_side.EncoderSide`, a length index per stream into the LLM, each encoder's
inputs for this rank, gradient sync over each encoder's own DP group and its share of the
global clipping norm over its own TP group (DESIGN.md 4.4, last bullet).

LLaVA's plain graph (vision -> projector -> llm) keeps `hcp.model.llava.LlavaEncoder`;
`several_streams(cfg)` says which one the trainer builds.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hcp.config.modules import encoder_names, module_cfg, rows_per_item, streams
from hcp.model import init_parameters
from hcp.model.encoder_side import EncoderSide
from hcp.plan.lengths import build_length_index, stream_indexes
from hcp.train.modules import module_sq_norm, sync_grads


def several_streams(cfg) -> bool:
    """Whether the graph is more than vision -> projector -> llm: named encoders or projectors
    (a join, a branch)."""
    return cfg.get("vision") is not None and (len(encoder_names(cfg)) > 1 or len(streams(cfg.graph.edges)) > 1)


def build_encoder_side(cfg, groups, layouts, device) -> EncoderSide:
    """Every encoder and projector of the config on its own TP group (projectors share their
    encoder's), initialized layout-invariantly from (seed, FQN), frozen per module's `freeze`."""
    flows = streams(cfg.graph.edges)
    encoders = {e: module_cfg(cfg, e) for e in encoder_names(cfg)}
    projectors = {s.projector: module_cfg(cfg, s.projector) for s in flows}
    tp = {e: groups.group(e, "tp") if layouts[e].tp > 1 else None for e in encoders}
    torch.manual_seed(cfg.seed)
    side = EncoderSide(encoders, projectors, flows, cfg.llm.hidden_size, tp)
    init_parameters(side, cfg.seed)
    for m in (*encoders, *projectors):
        if module_cfg(cfg, m).freeze:
            getattr(side, m).requires_grad_(False)
    return side.to(device)


class LengthIndexes:
    """The length index of the default stream (LLaVA's `<image>` rows, or a text-only model's
    lengths) and, with several streams, one per stream into the LLM (`stream_indexes`)."""

    def __init__(self, cfg, dataset, tok):
        flows = streams(cfg.graph.edges) if hasattr(dataset, "stream_ids") else ()
        self.streams = stream_indexes(dataset, dataset.stream_ids, {s.projector: rows_per_item(cfg, s) for s in flows},
                                      {s.projector: s.encoder for s in flows}) if flows else {}
        first = "projector" if "projector" in self.streams else flows[0].projector if flows else None
        self.default = self.streams[first] if first else build_length_index(dataset, tok.image_token_id, 0)

    def take(self, indices):
        """(the batch's default sizes, {projector: sizes} of every stream or {})."""
        return self.default.take(indices), {p: ix.take(indices) for p, ix in self.streams.items()}


def encoder_inputs(dataset, indices, mine, names, device) -> dict:
    """{encoder: this rank's encoder samples' inputs [I, C, H, W]} (`mine`: its `RankPlan`)."""
    return {e: torch.cat([dataset.pixel_values(dataset[indices[s]], e) for s in mine.encoder_samples[e]]).to(device)
            for e in names}


def _params(side: EncoderSide, encoder: str):
    """Parameters of `encoder` and of the projectors it feeds."""
    return [p for m in (encoder, *side.streams_of(encoder)) for p in getattr(side, m).parameters()]


def sync_encoder_grads(side: EncoderSide, groups, counts) -> float:
    """Sum each encoder's (and its projectors') gradients over the encoder's DP group; an encoder
    whose streams had no row anywhere in the batch gets no gradient (as in one process).
    Returns this rank's own squared gradient norm before the sum (a check that it got one)."""
    own = sum(float(p.grad.double().pow(2).sum()) for p in side.parameters() if p.grad is not None)
    for e in side.encoder_names:
        params = _params(side, e)
        sync_grads(params, groups.group(e, "dp"))
        if sum(counts.stream_rows.get(p, 0) for p in side.streams_of(e)) == 0:
            for p in params:
                p.grad = None
    return own


def encoder_sq_norm(side: EncoderSide, device) -> torch.Tensor:
    """Squared gradient norm of the whole encoder side (0-d float64): each encoder with its
    projectors over its own TP group (collectives in encoder order, the same on every rank)."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for e in side.encoder_names:
        sq = sq + module_sq_norm(_params(side, e), device, side.tp_groups.get(e))
    return sq


def whole_encoder_side(side: EncoderSide, cfg, device) -> EncoderSide:
    """The encoder side whole on this rank (evaluation encodes prompts' inputs in place): itself
    when no encoder uses TP, else a copy whose TP shards are gathered over each encoder's TP
    group (collectives in parameter order: every rank evaluates)."""
    if all(g is None for g in side.tp_groups.values()):
        return side
    whole = EncoderSide({e: module_cfg(cfg, e) for e in side.encoder_names},
                        {s.projector: module_cfg(cfg, s.projector) for s in side.streams}, side.streams,
                        cfg.llm.hidden_size).to(device)
    owner = {m: e for e in side.encoder_names for m in (e, *side.streams_of(e))}
    state = {}
    for name, p in side.named_parameters():
        spec = getattr(p, "shard_spec", None)
        if spec is None:
            state[name] = p.detach()
            continue
        parts = [torch.empty_like(p) for _ in range(spec.world)]
        dist.all_gather(parts, p.detach().contiguous(), group=side.tp_groups[owner[name.split(".")[0]]])
        state[name] = torch.cat(parts, dim=spec.dim)
    whole.load_state_dict(state)
    return whole
