"""Point-to-point links between pipeline stages: batched exchanges of tensors of known shapes.

Every stage learns all micro-batches' metadata once per step, before the schedule
(`broadcast_metas`: the first stage, which holds the data, broadcasts every micro-batch's
cu_seqlens, position ids and labels over the `pp` group), so every receive in the schedule can
allocate its buffer up front and no header travels ahead of a tensor. That is what lets a
schedule post a step's sends and receives together in one `dist.batch_isend_irecv`
(`StageLink.exchange`), which NCCL needs: it runs one pair of ranks' operations in order on one
stream, and a send larger than its buffers waits for the matching receive, so a lone send each
way between two stages deadlocks (`hcp.schedule.actions`).

The step plan (issue 12) will compute the same metadata on every rank locally; that swap
replaces `broadcast_metas` at its one call site (`hcp.train.step.StepRunner._metas`).
NCCL: the first point-to-point call on a group must come after a collective on it (here the
metadata broadcast), and each rank must have set its CUDA device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class StageMeta:
    """What a non-first stage knows of a micro-batch: cu_seqlens int32 [N + 1], max_seqlen int,
    position_ids long [T] and labels long [T] (already shifted, -100 = ignore) of the WHOLE
    micro-batch (before CP); cu_seqlens_host: the same boundaries on the host (numpy; CP plans
    from it)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    position_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens_host: np.ndarray | None = None

    @classmethod
    def of(cls, batch) -> "StageMeta":
        return cls(batch.cu_seqlens, int(batch.max_seqlen), batch.position_ids, batch.labels,
                   getattr(batch, "cu_seqlens_host", None))

    def sizes(self) -> list[int]:
        """[N + 1, T, max_seqlen]: what a receiver needs to split `flat`."""
        return [self.cu_seqlens.numel(), self.labels.numel(), self.max_seqlen]

    def flat(self) -> torch.Tensor:
        """long [N + 1 + 2T]: the tensors in one message."""
        return torch.cat([self.cu_seqlens.long(), self.position_ids.long(), self.labels.long()])

    @classmethod
    def unflat(cls, flat: torch.Tensor, num_cu: int, max_seqlen: int) -> "StageMeta":
        t = (flat.numel() - num_cu) // 2
        cu, pos, labels = flat.split([num_cu, t, t])
        cu = cu.to(torch.int32)
        return cls(cu, max_seqlen, pos, labels, cu.cpu().numpy())  # this path reads back anyway


def broadcast_metas(batches, num_micro: int, group, src: int, device) -> list[StageMeta]:
    """Every micro-batch's `StageMeta` on every stage of `group`, from global rank `src` (the
    first stage, which passes its `num_micro` micro-batches as `batches`; None elsewhere).

    Two broadcasts: sizes long [num_micro, 3], then all metadata long [sum of N + 1 + 2T].
    """
    if batches is not None:
        metas = [StageMeta.of(b) for b in batches]
        sizes = torch.tensor([m.sizes() for m in metas], dtype=torch.long, device=device).view(-1, 3)
    else:
        sizes = torch.empty(num_micro, 3, dtype=torch.long, device=device)
    if num_micro == 0:
        return []
    dist.broadcast(sizes, src, group=group)
    if batches is not None:
        flat = torch.cat([m.flat().to(device) for m in metas])
    else:
        flat = torch.empty(int(sizes[:, 0].sum() + 2 * sizes[:, 1].sum()), dtype=torch.long,
                           device=device)
    dist.broadcast(flat, src, group=group)
    if batches is not None:
        return metas
    rows = sizes.tolist()
    parts = flat.split([cu + 2 * t for cu, t, _ in rows])
    return [StageMeta.unflat(part, cu, max_seqlen) for part, (cu, _, max_seqlen) in zip(parts, rows)]


_TAGS = {"F": 0, "B": 1}  # activations and gradients (gloo matches tags; NCCL ignores them)


class StageLink:
    """This rank's point-to-point link to the other stages of its pipeline.

    Args:
        pp_ranks: global ranks of this rank's `pp` group, stage order; stage: this rank's stage
        index; device: where receive buffers live; group: the `pp` process group.
    """

    def __init__(self, pp_ranks, stage: int, device, group=None):
        self.ranks, self.stage, self.device, self.group = list(pp_ranks), stage, device, group

    def exchange(self, ops) -> None:
        """Post every op of one schedule step in one `batch_isend_irecv` and wait for all.

        ops: (is_send, tensor, peer stage, "F" | "B") each; a receive fills its (preallocated,
        contiguous) tensor in place.
        """
        p2p = [dist.P2POp(dist.isend if is_send else dist.irecv, tensor, self.ranks[peer],
                          self.group, _TAGS[kind]) for is_send, tensor, peer, kind in ops]
        for work in dist.batch_isend_irecv(p2p):
            work.wait()
