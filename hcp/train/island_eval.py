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

from hcp.model.encoder_stage import EncoderStage
from hcp.model.stage import StageSpec
from hcp.parallel.grid import Grid
from hcp.parallel.groups import new_group
from hcp.train.modules import whole_state


def whole_island_encoders(islands, encoder) -> nn.Module | None:
    """Every island's encoder and projectors whole, as children named after their modules
    (`vision`, `projector`, `vision2`, ...) of one module, on the LLM's first-stage ranks; None
    elsewhere. `islands`: this rank's
    `hcp.train.islands.Islands`; `encoder`: its `EncoderStage` or None. A collective: every rank
    calls it (new groups are made once, on the first call, in island order, kept in
    `islands.eval_groups`)."""
    specs, layouts, rank, device = islands.specs, islands.layouts, islands.rank, islands.device
    llm_first = [int(r) for r in Grid.of(layouts["llm"]).ranks[0].ravel()]
    if islands.eval_groups is None:
        islands.eval_groups = {}
        for head in islands.heads:  # every rank calls new_group, in the same order
            grid = Grid.of(layouts[head])
            senders = [grid.rank_at(pp=s) for s in range(layouts[head].pp)]
            islands.eval_groups[head] = (senders, new_group(sorted({*senders, *llm_first})))
    state = {}
    if encoder is not None:  # TP shards gathered (a collective over the island's TP group)
        state = (whole_state(encoder, encoder.tp_group)
                 or {n: p.detach() for n, p in encoder.named_parameters()})
    whole = nn.Module() if rank in llm_first else None
    for head in islands.heads:
        senders, group = islands.eval_groups[head]
        if rank not in senders and whole is None:
            continue
        lay = layouts[head]
        projectors = {p: specs[p].arch for p in islands.streams[head]}

        def stage(spec, device="meta"):
            with torch.device(device):
                return EncoderStage(head, specs[head].arch, projectors, specs.llm.hidden_size, spec)
        received = {}
        for s, src in enumerate(senders):
            shapes = [(n, p.shape)
                      for n, p in stage(StageSpec.of(lay.pp_layers, s)).named_parameters()]
            flat = (torch.cat([state[n].flatten() for n, _ in shapes]) if rank == src else
                    torch.empty(sum(shape.numel() for _, shape in shapes), device=device))
            dist.broadcast(flat, src, group=group)
            for (n, shape), t in zip(shapes, flat.split([shape.numel() for _, shape in shapes])):
                received[n] = t.view(shape)
        if whole is not None:
            island = stage(StageSpec.whole(sum(lay.pp_layers)), device)
            island.load_state_dict(received, assign=True)
            for name, child in island.named_children():
                whole.add_module(name, child)
    return whole
