"""THD packing: samples -> token-major micro-batches with `cu_seqlens`.

A micro-batch concatenates its documents along tokens (`[T]`, `T = sum of lengths`); document
boundaries are the int32 prefix sums `cu_seqlens` (`[N + 1]`), position ids restart at 0 in every
document, and attention never crosses a boundary. Labels arrive already shifted (docs/design.md
section 3); packing never shifts them again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from hcp.data.host import first_fit  # noqa: F401 - packing's static policy, torch-free there
from hcp.parallel.upload import upload


@dataclass
class Batch:
    """One THD micro-batch for one rank.

    input_ids / labels / position_ids: `[T]` int64; cu_seqlens: `[N + 1]` int32; max_seqlen: int;
    pixel_values: `[I, C, H, W]` fp32 or None (images in order of appearance); image_mask: `[T]`
    bool, True where an image embedding replaces the placeholder; sample_ids: N record ids.
    Several streams into the LLM (`hcp.config.modules`): stream_masks {projector: bool [T]} of
    every stream but the default `projector`; encoder_pixels {encoder: [I_e, C, H, W]} of every
    named encoder (the single-process model encodes them; `hcp.model.llava`).
    Host copies, so the model never reads them back from the device: seqlens, the N
    document lengths (cu_seqlens' differences); loss_tokens, the number of labels != -100 (None:
    not known on the host, read from the device when needed).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    pixel_values: Optional[torch.Tensor]
    image_mask: torch.Tensor
    sample_ids: list = field(default_factory=list)
    stream_masks: dict = field(default_factory=dict)
    encoder_pixels: dict = field(default_factory=dict)
    seqlens: Optional[tuple] = None
    loss_tokens: Optional[int] = None

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else upload(t, device)  # noqa: E731
        return Batch(move(self.input_ids), move(self.labels), move(self.position_ids),
                     move(self.cu_seqlens), self.max_seqlen, move(self.pixel_values),
                     move(self.image_mask), self.sample_ids,
                     {k: move(v) for k, v in self.stream_masks.items()},
                     {k: move(v) for k, v in self.encoder_pixels.items()}, self.seqlens,
                     self.loss_tokens)


def collate(samples, pixel_values: list[torch.Tensor], image_token_id: int,
            stream_ids: dict | None = None, encoder_pixels: dict | None = None) -> Batch:
    """Concatenate samples into one THD `Batch`.

    Args:
        samples: `hcp.data.llava.Sample`s (input_ids, labels of equal length S_i).
        pixel_values: per sample `[I_i, C, H, W]` (I_i may be 0).
        image_token_id: the placeholder id that marks image-token positions.
        stream_ids: {projector: placeholder id} of the other streams into the LLM
            (`hcp.data.build.stream_token_ids`; the default `projector` is `image_token_id`).
        encoder_pixels: {encoder: per sample `[I_i, C, H, W]`} of named encoders.
    """
    lengths = [len(s.input_ids) for s in samples]
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    input_ids = torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.long)
    labels = torch.tensor([t for s in samples for t in s.labels], dtype=torch.long)
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    images = [p for p in pixel_values if p.shape[0] > 0]
    masks = {p: input_ids == i for p, i in (stream_ids or {}).items() if p != "projector"}
    return Batch(input_ids, labels, position_ids, cu, max(lengths),
                 torch.cat(images) if images else None, input_ids == image_token_id,
                 [s.id for s in samples], masks,
                 {e: torch.cat(per) for e, per in (encoder_pixels or {}).items() if per},
                 tuple(lengths), int((labels != -100).sum()))


def empty_batch(device=None) -> Batch:
    """A micro-batch that contributes nothing: one 1-token document (token 0, label -100, no
    image). It still runs every layer, so it joins every collective of a forward and backward
    (FSDP all-gathers and reduce-scatters, TP and CP collectives, pipeline sends) while adding
    zero loss, zero loss tokens and zero gradient. Under CP the head-tail sharding pads it to
    2 * cp slots (one per chunk)."""
    one = torch.zeros(1, dtype=torch.long, device=device)
    return Batch(one, torch.full_like(one, -100), one.clone(),
                 torch.tensor([0, 1], dtype=torch.int32, device=device), 1, None,
                 torch.zeros(1, dtype=torch.bool, device=device), [], seqlens=(1,), loss_tokens=0)


def pad_micro_batches(batches: list[Batch], n: int, device=None) -> list[Batch]:
    """`batches` followed by `empty_batch`es up to `n` micro-batches, so every rank sharing a
    collective runs the same number of micro-batches whatever its data.

    Raises ValueError when there are already more than `n`.
    """
    if len(batches) > n:
        raise ValueError(f"{len(batches)} micro-batches cannot be padded to {n}")
    return list(batches) + [empty_batch(device) for _ in range(n - len(batches))]
