"""Point-to-point links between neighbouring pipeline stages; shapes travel before tensors.

A forward message from stage s to s+1 is three non-blocking sends on the module's `pp` group:
a fixed-size header (long [6]: number of cu_seqlens entries, micro-batch tokens T, max_seqlen,
activation rows, activation columns, activation dtype code), the micro-batch metadata (long
[N + 1 + 2T], `StageMeta.flat`) and the activation itself. The receiver reads the
header first and then allocates exactly the announced sizes: no buffer is sized by a maximum
length, so the number of tokens may change with every micro-batch. A backward message (the
gradient of an activation, s+1 -> s) needs no header: its receiver sent that activation.

Sends are posted with `isend` and waited only in `flush()` (at the end of a schedule); receives
block. With every send non-blocking, any schedule whose receives each match a send the peer
posts earlier in its own order cannot deadlock (1F1B, Narayanan et al. 2021, is such a
schedule). Tags separate the message kinds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class StageMeta:
    """What a non-first stage knows of a micro-batch (sent with its activations by the first
    stage, which holds the data): cu_seqlens int32 [N + 1], max_seqlen int, position_ids long [T]
    and labels long [T] (already shifted, -100 = ignore) of the WHOLE micro-batch (before CP)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    position_ids: torch.Tensor
    labels: torch.Tensor

    @classmethod
    def of(cls, batch) -> "StageMeta":
        return cls(batch.cu_seqlens, int(batch.max_seqlen), batch.position_ids, batch.labels)

    def flat(self) -> torch.Tensor:
        """long [N + 1 + 2T]: the tensors in one message."""
        return torch.cat([self.cu_seqlens.long(), self.position_ids.long(), self.labels.long()])

    @classmethod
    def unflat(cls, flat: torch.Tensor, num_cu: int, max_seqlen: int) -> "StageMeta":
        t = (flat.numel() - num_cu) // 2
        cu, pos, labels = flat.split([num_cu, t, t])
        return cls(cu.to(torch.int32), max_seqlen, pos, labels)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEADER, _META, _ACT, _GRAD = range(4)


class StageLink:
    """This rank's links to the previous and next stage of its pipeline.

    Args:
        pp_ranks: global ranks of this rank's `pp` group, stage order.
        stage: this rank's stage index; device: where received tensors are allocated.
    """

    def __init__(self, pp_ranks, stage: int, device, group=None):
        self.prev = pp_ranks[stage - 1] if stage > 0 else None
        self.next = pp_ranks[stage + 1] if stage + 1 < len(pp_ranks) else None
        self.device, self.group = device, group
        self._pending: list = []

    def send_forward(self, x: torch.Tensor, meta: StageMeta) -> None:
        """Post the header, the metadata and the activation x [rows, cols] to the next stage.

        Raises ValueError for an activation that is not 2-D or has an unsupported dtype.
        """
        if x.dim() != 2 or x.dtype not in _DTYPES:
            raise ValueError(f"stage activations must be 2-D {_DTYPES}, got {x.dtype} {tuple(x.shape)}")
        flat = meta.flat().to(self.device)
        header = torch.tensor([meta.cu_seqlens.numel(), meta.labels.numel(), meta.max_seqlen,
                               x.shape[0], x.shape[1], _DTYPES.index(x.dtype)], dtype=torch.long,
                              device=self.device)
        for tensor, tag in ((header, _HEADER), (flat, _META), (x.detach().contiguous(), _ACT)):
            self._pending.append(dist.isend(tensor, self.next, group=self.group, tag=tag))

    def recv_forward(self) -> tuple[torch.Tensor, StageMeta]:
        """Receive (activation [rows, cols] requiring grad, its micro-batch's metadata)."""
        header = torch.empty(6, dtype=torch.long, device=self.device)
        dist.recv(header, self.prev, group=self.group, tag=_HEADER)
        num_cu, tokens, max_seqlen, rows, cols, dtype = header.tolist()
        flat = torch.empty(num_cu + 2 * tokens, dtype=torch.long, device=self.device)
        x = torch.empty(rows, cols, dtype=_DTYPES[dtype], device=self.device)
        dist.recv(flat, self.prev, group=self.group, tag=_META)
        dist.recv(x, self.prev, group=self.group, tag=_ACT)
        return x.requires_grad_(), StageMeta.unflat(flat, num_cu, max_seqlen)

    def send_backward(self, grad: torch.Tensor) -> None:
        """Post the gradient of the activation received from the previous stage."""
        self._pending.append(dist.isend(grad.contiguous(), self.prev, group=self.group, tag=_GRAD))

    def recv_backward(self, like: torch.Tensor) -> torch.Tensor:
        """Receive the gradient of the activation `like` sent to the next stage."""
        grad = torch.empty_like(like, memory_format=torch.contiguous_format)
        dist.recv(grad, self.next, group=self.group, tag=_GRAD)
        return grad

    def flush(self) -> None:
        """Wait for every posted send (their buffers may then be freed)."""
        for work in self._pending:
            work.wait()
        self._pending.clear()
