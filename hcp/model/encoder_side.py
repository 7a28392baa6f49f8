"""The encoder side of a module graph: several encoders and their projectors, each stream of rows
into the LLM computed once (docs/design.md 1: join, branch; `hcp.config.modules`).

A *stream* (`hcp.config.modules.Stream`) is a projector fed by one encoder whose rows fill that
projector's placeholder positions in the LLM's merged sequence. Two encoders with a projector
each are a join; one encoder feeding two projectors is a branch: the tower runs once per input
batch, each projector reads its features, and the tower's gradient is the sum of both
consumers'. Modules are registered under their config names (`vision`, `projector`, `vision2`,
...), so FQNs, and with them initialization (hcp.model.init) and checkpoints, are those of the
single-process model (`hcp.model.llava.LlavaModel`) whatever the layout.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from hcp.config.modules import BUILT_IN, Stream
from hcp.model.collectives import copy_to_group
from hcp.model.projector import Projector
from hcp.model.encoder_types import build_encoder

DEFAULT_STREAMS = (Stream("projector", "vision"),)
"""LLaVA's graph: vision -> projector -> llm."""


def llava_kwargs(specs) -> dict:
    """`LlavaModel` keyword arguments of a run's modules (`hcp.config.specs.ModuleSpecs`): the
    `vision`, `projector` and `llm` architectures, the named encoders and projectors, the
    streams into the LLM. `LlavaModel(**llava_kwargs(specs))` is the whole single-process model."""
    def of(kind: str, built_in: bool) -> dict:
        return {m.name: m.arch for m in specs.of_kind(kind) if (m.name in BUILT_IN) == built_in}
    return dict(vision_cfg=of("encoder", True).get("vision"),
                projector_cfg=of("projector", True).get("projector"), llm_cfg=specs.llm.arch,
                encoders=of("encoder", False), projectors=of("projector", False),
                streams=specs.streams)


def add_encoder_modules(parent: nn.Module, encoders: Mapping, projectors: Mapping, streams,
                        llm_hidden: int, tp_groups: Mapping | None = None,
                        cp_groups: Mapping | None = None) -> None:
    """Register on `parent` one encoder (`build_encoder`) per entry of `encoders` (name ->
    EncoderArch) and one `Projector` per stream (from its encoder's width to `llm_hidden`), under
    their names. `tp_groups` / `cp_groups`: encoder name -> its TP / CP group (None: size 1); a
    projector uses its encoder's TP group.

    Raises ValueError when a stream names an encoder or projector without a config."""
    tp_groups, cp_groups = tp_groups or {}, cp_groups or {}
    for name, cfg in encoders.items():
        parent.add_module(name,
                          build_encoder(cfg, tp_groups.get(name), cp_group=cp_groups.get(name)))
    for s in streams:
        if s.encoder not in encoders or s.projector not in projectors:
            raise ValueError(f"stream {s.encoder} -> {s.projector} -> llm: no config for "
                             f"{s.encoder if s.encoder not in encoders else s.projector}")
        parent.add_module(s.projector,
                          Projector(projectors[s.projector], encoders[s.encoder].hidden_size,
                                    llm_hidden, tp_groups.get(s.encoder)))


def encode_streams(parent: nn.Module, streams, encoder: str, pixel_values: torch.Tensor) -> dict:
    """Run `encoder` (a child of `parent`) once over pixel_values [I, C, H, W] and every stream
    it feeds: {projector: rows [I * R_s, H]} (R_s rows per input of stream s, inputs in order)."""
    feats = getattr(parent, encoder)(pixel_values)                         # [I, P, D]
    out = {}
    for s in streams:
        if s.encoder == encoder:
            rows = getattr(parent, s.projector)(feats)                     # [I, R_s, H]
            out[s.projector] = rows.reshape(-1, rows.shape[-1])
    return out


class EncoderSide(nn.Module):
    """Encoders and projectors as their own module (colocated: every rank runs them at their
    own TP/DP layout and routes each stream's rows to the LLM's shards, `hcp.schedule.colocated`).

    Args:
        encoders: name -> EncoderArch of every encoder (`vision` first for LLaVA).
        projectors: name -> ProjectorArch of every projector.
        streams: the streams into the LLM (`hcp.config.modules.streams`), in edge order.
        llm_hidden: the LLM's hidden size H.
        tp_groups: encoder name -> TP group (its projectors share it); None: TP size 1.
        cp_groups: encoder name -> CP group (`hcp.model.vit`); None: CP size 1.

    `forward(inputs)`: {encoder: pixel_values [I_e, C, H, W]} -> {projector: rows [I_e * R_s, H]},
    every stream; each output passes Megatron's copy-to-TP-region of its encoder's TP group
    (identity forward, gradient all-reduce backward), as `hcp.model.llava.LlavaEncoder`'s.
    An encoder missing from `inputs` gets 0 inputs.
    """

    def __init__(self, encoders: Mapping, projectors: Mapping, streams, llm_hidden: int,
                 tp_groups: Mapping | None = None, cp_groups: Mapping | None = None):
        super().__init__()
        self.streams = tuple(streams)
        self.encoder_names = tuple(encoders)
        self.tp_groups = dict(tp_groups or {})
        self._input_shape = {e: (c.num_channels, c.image_size, c.image_size)
                             for e, c in encoders.items()}
        add_encoder_modules(self, encoders, projectors, self.streams, llm_hidden, self.tp_groups,
                            cp_groups)

    def streams_of(self, encoder: str) -> tuple[str, ...]:
        """Projectors fed by `encoder`, in stream order."""
        return tuple(s.projector for s in self.streams if s.encoder == encoder)

    def forward(self, inputs: Mapping) -> dict:
        out = {}
        for e in self.encoder_names:
            x = inputs.get(e)
            if x is None:
                x = torch.zeros(0, *self._input_shape[e], device=next(self.parameters()).device)
            for p, rows in encode_streams(self, self.streams, e, x).items():
                out[p] = copy_to_group(rows, self.tp_groups.get(e))
        return out
