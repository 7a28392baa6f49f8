"""Pipeline stages of the LLM: which decoder layers a stage holds (the per-micro-batch metadata
that travels between stages is `hcp.comm.p2p.StageMeta`).

A stage holds the contiguous layers `[start, stop)` of the decoder (uneven splits come from
`llm.layout.pp_layers`). The first stage also holds the token embedding and, colocated with it,
the vision encoder and projector; the last stage holds the final norm, the LM head and the loss.
Layers keep their global index in their names (`llm.layers.7.attn.q_proj.weight` on whichever
stage holds layer 7), so init and checkpoints do not depend on the split.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate



@dataclass(frozen=True)
class StageSpec:
    """Stage `index` of `num_stages`, holding decoder layers [start, stop)."""

    index: int
    num_stages: int
    start: int
    stop: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    @classmethod
    def whole(cls, num_layers: int) -> "StageSpec":
        """The single stage of an unpipelined model."""
        return cls(0, 1, 0, num_layers)

    @classmethod
    def of(cls, pp_layers, index: int) -> "StageSpec":
        """Stage `index` of the split `pp_layers` (layers per stage, e.g. (1, 2, 2, 1)).

        Raises ValueError for an index outside the split.
        """
        if not 0 <= index < len(pp_layers):
            raise ValueError(f"stage {index} is outside the {len(pp_layers)} stages of "
                             f"{list(pp_layers)}")
        bounds = [0, *accumulate(pp_layers)]
        return cls(index, len(pp_layers), bounds[index], bounds[index + 1])
