"""Evaluation under placement=non_colocated: every encoder island's weights made whole on the
LLM's first stage (`hcp.train.islands`).

Greedy decoding re-encodes each prompt's inputs inside the LLM's first stage (as colocated
evaluation does), so the LLM's first-stage ranks need every encoder and projector whole. Each
island sends them: every stage's TP shards are gathered inside the island (lane 0's ranks send),
then one broadcast per stage over a group of that island's senders and the LLM's first stage.
Shapes come from the config (a meta-device copy of each stage), so nothing is exchanged to
learn them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hcp.config.modules import module_cfg
from hcp.model.encoder_stage import EncoderStage
from hcp.model.stage import StageSpec
from hcp.parallel.grid import Grid
from hcp.train.modules import whole_state


def whole_island_encoders(tr) -> nn.Module | None:
    """Every island's encoder and projectors whole, as children named after their modules
    (`vision`, `projector`, `vision2`, ...) of one module, on the LLM's first-stage ranks; None
    elsewhere. `tr`: an `hcp.train.islands.IslandTrainer`. A collective: every rank calls it
    (new groups are made once, on the first call, in island order)."""
    cfg, layouts = tr.cfg, tr.layouts
    llm_first = [int(r) for r in Grid.of(layouts["llm"]).ranks[0].ravel()]
    if getattr(tr, "_eval_groups", None) is None:
        tr._eval_groups = {}
        for head in tr.heads:  # every rank calls new_group, in the same order
            grid = Grid.of(layouts[head])
            senders = [grid.rank_at(pp=s) for s in range(layouts[head].pp)]
            tr._eval_groups[head] = (senders, dist.new_group(sorted({*senders, *llm_first})))
    state = {}
    if tr.encoder is not None:  # TP shards gathered (a collective over the island's TP group)
        state = (whole_state(tr.encoder, tr.encoder.tp_group)
                 or {n: p.detach() for n, p in tr.encoder.named_parameters()})
    whole = nn.Module() if tr.rank in llm_first else None
    for head in tr.heads:
        senders, group = tr._eval_groups[head]
        if tr.rank not in senders and whole is None:
            continue
        lay = layouts[head]
        projectors = {p: module_cfg(cfg, p) for p in tr.island_streams[head]}

        def stage(spec, device="meta"):
            with torch.device(device):
                return EncoderStage(head, module_cfg(cfg, head), projectors, cfg.llm.hidden_size, spec)
        received = {}
        for s, src in enumerate(senders):
            shapes = [(n, p.shape) for n, p in stage(StageSpec.of(lay.pp_layers, s)).named_parameters()]
            flat = (torch.cat([state[n].flatten() for n, _ in shapes]) if tr.rank == src else
                    torch.empty(sum(shape.numel() for _, shape in shapes), device=tr.device))
            dist.broadcast(flat, src, group=group)
            for (n, shape), t in zip(shapes, flat.split([shape.numel() for _, shape in shapes])):
                received[n] = t.view(shape)
        if whole is not None:
            island = stage(StageSpec.whole(sum(lay.pp_layers)), tr.device)
            island.load_state_dict(received, assign=True)
            for name, child in island.named_children():
                whole.add_module(name, child)
    if tr.model is None or not tr.stage.first:
        return None
    return whole
