"""The trainer's encoder side when the module graph has several encoders or streams (colocated
placement): named encoders and projectors (`hcp.config.modules`) built as one
`hcp.model.encoder_side.EncoderSide`, a length index per stream into the LLM, each encoder's
inputs for this rank, gradient sync over each encoder's own DP group and its share of the
global clipping norm over its own TP group (docs/design.md 4.4, last bullet).

LLaVA's plain graph (vision -> projector -> llm) keeps `hcp.model.llava.LlavaEncoder`
(`ModuleSpecs.several_streams` says which one the trainer builds); the helpers that take `encoder`
accept either, so the trainer has one code path.
"""
from __future__ import annotations

import torch

from hcp.model.encoder_side import EncoderSide
from hcp.model.llava import LlavaEncoder
from hcp.model.init import meta_build
from hcp.parallel.upload import upload
from hcp.plan.lengths import LengthIndexes  # noqa: F401 - the trainer's `sides.LengthIndexes`
from hcp.train.modules import encoder_sq_norm, module_sq_norm, sync_grads, whole_state


def build_encoder(specs, groups):
    """The colocated encoder side on the meta device (`hcp.model.init.materialize` makes this
    rank's shards): a `LlavaEncoder` (vision + projector on vision's TP / CP groups) for the
    default graph, an `EncoderSide` for named encoders or streams, None for a text-only LM.
    `specs`: `hcp.config.specs.ModuleSpecs` with layouts."""
    if "vision" not in specs or specs.several_streams:
        return build_encoder_side(specs, groups) if "vision" in specs else None
    vision = specs["vision"].layout
    tp = groups.group("vision", "tp") if vision.tp > 1 else None
    cp = groups.group("vision", "cp") if vision.cp > 1 else None
    with meta_build():
        encoder = LlavaEncoder(specs["vision"].arch, specs["projector"].arch, specs.llm.hidden_size,
                               tp_group=tp, cp_group=cp)
    for name in ("vision", "projector"):
        if specs[name].freeze:
            encoder.get_submodule(name).requires_grad_(False)
    return encoder


def _side_blocks(specs, encoders) -> tuple[dict, dict]:
    """({encoder: block}, {projector: block}) of `encoders` and the streams they feed."""
    return ({e: specs[e].arch for e in encoders},
            {s.projector: specs[s.projector].arch for s in specs.streams if s.encoder in encoders})


def build_encoder_side(specs, groups) -> EncoderSide:
    """Every encoder and projector of the config on its own TP group (projectors share their
    encoder's), frozen per module's `freeze`, on the meta device: `hcp.model.init.materialize`
    makes this rank's shards, layout-invariantly from (seed, FQN)."""
    encoders, projectors = _side_blocks(specs, [m.name for m in specs.of_kind("encoder")])
    tp = {e: groups.group(e, "tp") if specs[e].layout.tp > 1 else None for e in encoders}
    cp = {e: groups.group(e, "cp") if specs[e].layout.cp > 1 else None for e in encoders}
    with meta_build():
        side = EncoderSide(encoders, projectors, specs.streams, specs.llm.hidden_size, tp, cp)
    for m in (*encoders, *projectors):
        if specs[m].freeze:
            getattr(side, m).requires_grad_(False)
    return side


def encoder_inputs(dataset, indices, mine, encoder, device):
    """This rank's encoder samples' inputs: [I, C, H, W] of `vision` for a `LlavaEncoder`, or
    {encoder: [I_e, C, H, W]} for an `EncoderSide` (`mine`: the rank's `RankPlan`)."""
    if not isinstance(encoder, EncoderSide):
        samples = mine.encoder_samples["vision"]
        return upload(torch.cat([dataset.pixel_values(dataset[indices[s]]) for s in samples]),
                      device)
    return {e: upload(torch.cat([dataset.pixel_values(dataset[indices[s]], e)
                                 for s in mine.encoder_samples[e]]), device)
            for e in encoder.encoder_names}


def attach_rows(batches, leaf) -> None:
    """Give each first-stage micro-batch `(mb, batch)` its routed rows: `batch.image_rows` from
    one leaf tensor, or with several streams (a {projector: leaf} dict) each stream's rows
    (`batch.stream_rows`; the default `projector`'s in `image_rows`)."""
    for mb, batch in batches:
        if isinstance(leaf, dict):
            rows = {p: leaf[p][a:b] for p, (a, b) in mb.stream_rows.items()}
            batch.image_rows, batch.stream_rows = rows.pop("projector", None), rows
        else:
            batch.image_rows = leaf[mb.image_rows[0]:mb.image_rows[1]]


def colocated_phases(step, encoder, inputs, mine, batches):
    """`ColocatedStep.phases` of this rank's step (`mine`: its `RankPlan`): the plan's routes
    into the LLM; the routed rows go to its first-stage micro-batches `batches` ((plan, batch)
    pairs, or None) by `attach_rows`."""
    several = isinstance(encoder, EncoderSide)

    def attach(leaves):
        if batches is not None:
            attach_rows(batches, leaves if several else leaves["projector"])
    return step.phases(inputs, {s: r for (s, d), r in mine.routes.items() if d == "llm"}, attach)


def _members(side: EncoderSide, encoder: str):
    """`encoder` and the projectors it feeds, by name."""
    return (encoder, *side.streams_of(encoder))


def _params(side: EncoderSide, encoder: str):
    return [p for m in _members(side, encoder) for p in getattr(side, m).parameters()]


def sync_encoder_grads(encoder, groups, counts) -> None:
    """Sum the encoder side's gradients over each encoder's own DP x CP group (a projector with
    its encoder's; under encoder CP each rank's are partial sums over its tokens); an encoder whose
    streams had no row anywhere in the batch gets no gradient, as in one process (LLaVA: no image in
    the batch)."""
    if not isinstance(encoder, EncoderSide):
        sync_grads(encoder.parameters(), groups.group("vision", "dp_cp"))
        if counts.image_rows == 0:
            for p in encoder.parameters():
                p.grad = None
        return
    for e in encoder.encoder_names:
        params = _params(encoder, e)
        sync_grads(params, groups.group(e, "dp_cp"))
        if sum(counts.stream_rows.get(p, 0) for p in encoder.streams_of(e)) == 0:
            for p in params:
                p.grad = None


def sq_norm(encoder, device, groups) -> torch.Tensor:
    """Squared gradient norm of the whole encoder side (0-d float64, the same on every rank):
    `hcp.train.modules.encoder_sq_norm` for a `LlavaEncoder`; for an `EncoderSide` each encoder
    with its projectors over its own TP group (collectives in encoder order)."""
    if not isinstance(encoder, EncoderSide):
        return encoder_sq_norm(encoder, device, groups)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for e in encoder.encoder_names:
        sq = sq + module_sq_norm(_params(encoder, e), device, encoder.tp_groups.get(e))
    return sq


def tp_groups(encoder) -> dict:
    """Module -> TP group of the encoder side's TP-sharded modules (checkpoints); {} without TP."""
    if isinstance(encoder, EncoderSide):
        return {m: encoder.tp_groups[e]
                for e in encoder.encoder_names if encoder.tp_groups.get(e) is not None
                for m in _members(encoder, e)}
    return {} if encoder is None or encoder.tp_group is None else {"vision": encoder.tp_group,
                                                                  "projector": encoder.tp_group}


def whole_encoder_side(side: EncoderSide, specs, device) -> EncoderSide:
    """The encoder side whole on this rank (evaluation encodes prompts' inputs in place): itself
    when no encoder uses TP or CP, else a copy (without CP) whose TP shards are gathered over
    each encoder's TP group (`hcp.train.modules.whole_state`, encoder by encoder: every rank
    calls it)."""
    if all(g is None for g in side.tp_groups.values()) and all(
            getattr(side, e).cp == 1 for e in side.encoder_names):
        return side
    whole = EncoderSide(*_side_blocks(specs, side.encoder_names), side.streams,
                        specs.llm.hidden_size).to(device)
    for e in side.encoder_names:
        for m in _members(side, e):
            state = whole_state(getattr(side, m), side.tp_groups.get(e))
            if state is not None:
                getattr(whole, m).load_state_dict(state)
            else:
                getattr(whole, m).load_state_dict(getattr(side, m).state_dict())
    return whole
