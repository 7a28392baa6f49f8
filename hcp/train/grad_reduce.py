"""Gradient sum over a DP (x CP) group in buckets, overlapped with the last backward.

The LLM's replicated gradients are reduced as torch's DDP reducer does it (Li et al., VLDB 2020):
trainable parameters in reverse registration order are cut into buckets (`FIRST_BUCKET_BYTES`,
then `BUCKET_BYTES`); during the last micro-batch's backward a bucket's flat all-reduce is
launched (`async_op`) once its gradients are final; `finish()` launches the rest, waits and hands
the sums back. A bucket launches only when complete AND every bucket before it has launched, so
every rank issues buckets 0..n-1 in the same order whatever its data; a parameter with no
gradient here joins with zeros. Buckets are fp32. FSDP-sharded modules use none of this."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

FIRST_BUCKET_BYTES = dist._DEFAULT_FIRST_BUCKET_BYTES  # 1 MiB: the first launch comes early
BUCKET_BYTES = 25 * 1024 * 1024                        # DDP's bucket_cap_mb default


def bucket_params(params, first_bytes: int = FIRST_BUCKET_BYTES,
                  bytes_each: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """`params` in reverse order, cut into buckets of at most `first_bytes` (the first) and
    `bytes_each` (the others) of one dtype each; a tensor larger than the cap is a bucket alone."""
    buckets, size, cap = [], 0, first_bytes
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if buckets and (size + nbytes <= cap and buckets[-1][-1].dtype == p.dtype):
            buckets[-1].append(p)
            size += nbytes
            continue
        if buckets:
            cap = bytes_each
        buckets.append([p])
        size = nbytes
    return buckets


class GradReducer:
    """Sums the gradients of the trainable `params` over `group` (size > 1) in buckets.

    Use per step: `sync_in_backward(enabled)` before each backward (True only before the last,
    as FSDP's `set_requires_gradient_sync`), then `finish()` after the schedule. Gradients
    accumulate locally until the last backward; each bucket's sum is written back as the
    parameters' `.grad` (views of the bucket's flat buffer).

    Args:
        params: the module's parameters (frozen ones, `requires_grad=False`, stay out on every
            rank); group: the process group to sum over; first_bytes, bytes_each: bucket caps.
    """

    def __init__(self, params, group, first_bytes: int = FIRST_BUCKET_BYTES,
                 bytes_each: int = BUCKET_BYTES):
        self.group = group
        self.buckets = bucket_params([p for p in params if p.requires_grad], first_bytes,
                                     bytes_each)
        self._bucket_of = {p: k for k, bucket in enumerate(self.buckets) for p in bucket}
        self._ready = [0] * len(self.buckets)
        self._launched: list[tuple[torch.Tensor, dist.Work]] = []
        self._armed = False
        for p in self._bucket_of:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def sync_in_backward(self, enabled: bool) -> None:
        """Called before each backward: True arms the hooks for this (the last) backward."""
        if enabled and self._launched:
            raise RuntimeError("GradReducer: a new step started before finish() of the last one")
        self._armed = enabled
        self._ready = [0] * len(self.buckets)

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        k = self._bucket_of[p]
        if k < len(self._launched):
            raise RuntimeError("GradReducer: a gradient changed after its bucket was launched "
                               "(a parameter accumulated twice in the last backward)")
        self._ready[k] += 1
        while (len(self._launched) < len(self.buckets)
               and self._ready[len(self._launched)] == len(self.buckets[len(self._launched)])):
            self._launch()

    def _launch(self) -> None:
        """All-reduce the next bucket in order (its gradients are final; None joins as zeros)."""
        bucket = self.buckets[len(self._launched)]
        flat = _flatten_dense_tensors([torch.zeros_like(p) if p.grad is None else p.grad
                                       for p in bucket])
        self._launched.append((flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def finish(self) -> None:
        """Launch the buckets not launched during backward (in order), wait for every one and
        set each parameter's `.grad` to its sum over the group."""
        self._armed = False
        while len(self._launched) < len(self.buckets):
            self._launch()
        for bucket, (flat, work) in zip(self.buckets, self._launched):
            work.wait()
            for p, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                p.grad = synced
        self._launched = []
