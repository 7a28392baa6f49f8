"""Point-to-point links between pipeline stages: batched exchanges of tensors of known shapes.

Every stage knows all micro-batches' metadata before the schedule (from the step plan, or
`broadcast_metas` from the first stage over the `pp` group), so every receive allocates its
buffer up front and a step's sends and receives go together in one `dist.batch_isend_irecv`
(`StageLink.exchange`): NCCL needs that, since a lone send each way between two stages
deadlocks once messages outgrow its buffers. NCCL: the first point-to-point call on a group must
follow a collective on it, and each rank must have set its CUDA device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from hcp.parallel.upload import upload


@dataclass
class StageMeta:
    """What a non-first stage knows of a micro-batch: cu_seqlens int32 [N + 1], max_seqlen int,
    position_ids long [T] and labels long [T] (already shifted, -100 = ignore) of the WHOLE
    micro-batch (before CP), and the host copies `seqlens` (document lengths) and `loss_tokens`
    (labels != -100) as in `hcp.data.packing.Batch` (None: not known on the host)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    position_ids: torch.Tensor
    labels: torch.Tensor
    seqlens: Optional[tuple] = None
    loss_tokens: Optional[int] = None

    @classmethod
    def of(cls, batch) -> "StageMeta":
        return cls(batch.cu_seqlens, int(batch.max_seqlen), batch.position_ids, batch.labels,
                   getattr(batch, "seqlens", None), getattr(batch, "loss_tokens", None))

    def sizes(self) -> list[int]:
        """[N + 1, T, max_seqlen]: what a receiver needs to split `flat`."""
        return [self.cu_seqlens.numel(), self.labels.numel(), self.max_seqlen]

    def flat(self) -> torch.Tensor:
        """long [N + 1 + 2T]: the tensors in one message."""
        return torch.cat([self.cu_seqlens.long(), self.position_ids.long(), self.labels.long()])

    @classmethod
    def unflat(cls, flat: torch.Tensor, num_cu: int, max_seqlen: int,
               host: Optional[list] = None) -> "StageMeta":
        """The inverse of `flat`; `host`: [cu_seqlens..., loss tokens] read on the host."""
        t = (flat.numel() - num_cu) // 2
        cu, pos, labels = flat.split([num_cu, t, t])
        seqlens = (None if host is None
                   else tuple(b - a for a, b in zip(host[:num_cu - 1], host[1:num_cu])))
        return cls(cu.to(torch.int32), max_seqlen, pos, labels, seqlens,
                   None if host is None else host[num_cu])


def broadcast_metas(batches, num_micro: int, group, src: int, device) -> list[StageMeta]:
    """Every micro-batch's `StageMeta` on every stage of `group`, from global rank `src` (the
    first stage, which passes its `num_micro` micro-batches as `batches`; None elsewhere).

    Two broadcasts: sizes long [num_micro, 3], then all metadata long [sum of N + 1 + 2T]; a
    receiving stage reads the sizes and every cu_seqlens and loss-token count back to the host
    once per step (the host copies of `StageMeta`), not once per micro-batch or layer.
    """
    if batches is not None:
        metas = [StageMeta.of(b) for b in batches]
        sizes = upload([m.sizes() for m in metas], device, torch.long).view(-1, 3)
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
    host = torch.cat([torch.cat([part[:cu], (part[cu + t:] != -100).sum()[None]])
                      for part, (cu, t, _) in zip(parts, rows)]).tolist()
    starts = [0]
    for cu, _, _ in rows:
        starts.append(starts[-1] + cu + 1)
    return [StageMeta.unflat(part, cu, max_seqlen, host[a:b])
            for part, (cu, _, max_seqlen), a, b in zip(parts, rows, starts, starts[1:])]


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
