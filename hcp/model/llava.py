"""LLaVA-style model: ViT encoder -> projector -> LLaMA decoder over one THD micro-batch.

Submodules are named after the config keys (`vision`, `projector`, `llm`, and named `encoders` /
`projectors`: hcp.model.encoder_side), so per-module freeze, optimizers and groups select
parameters by FQN prefix; `vision_cfg=None` makes a plain LM. The encoder runs inside the LLM's
first stage (`encoder=True`, the single-process reference: every TP x CP rank encodes the
micro-batch's images) or as its own module (`LlavaEncoder`) whose rows a route delivers
(`encoder=False`, reads `batch.image_rows`; docs/design.md 4.2, 4.4).

The micro-batch `batch` is any object with these attributes (shapes per micro-batch):
    input_ids     long [T]      token ids; ignored where image_mask is True
    labels        long [T]      ALREADY shifted targets, -100 = ignore; never shifted here
    position_ids  long [T]      restart at 0 in each document
    cu_seqlens    int32 [N + 1] document boundaries; max_seqlen: int
    seqlens       N ints on the host, or absent when cu_seqlens is on the CPU
    pixel_values  float [I, C, H, W] or None (images in order of appearance; `encoder=True`)
    image_mask    bool [T] or None: positions replaced, in order, by the I * P image embeddings
    image_rows    float [R, H] or None (`encoder=False`): this rank's CP shard's image rows,
                                in local slot order
  and, for streams other than the default `projector`:
    stream_masks    {projector: bool [T]}: that stream's positions
    encoder_pixels  {encoder: float [I_e, C, H, W]} (`encoder=True`): a named encoder's inputs
    stream_rows     {projector: float [R_s, H]} (`encoder=False`): routed rows, as image_rows

Every rank of a TP x CP group gets the same whole micro-batch; under CP `forward` returns this
rank's share of the loss and token count (summed over CP and DP they give the single-process
numbers). Pipeline stages (`stage`): a non-first stage gets a `hcp.comm.p2p.StageMeta` instead
of the batch; the last stage finishes with `loss` (default) or another head. `forward`,
`residual_shape` and `loss` take the micro-batch's `cp_group` (dynamic CP), by default the
model's."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hcp.config.specs import EncoderArch, LLMArch, ProjectorArch
from hcp.model.collectives import (copy_to_group, gather_from_group, gather_seq, group_rank,
                                   group_size)
from hcp.model.encoder_side import DEFAULT_STREAMS, add_encoder_modules, encode_streams
from hcp.model.llama import LlamaDecoder
from hcp.model.projector import Projector
from hcp.model.stage import StageSpec
from hcp.model.tp import vocab_parallel_cross_entropy
from hcp.model.encoder_types import build_encoder
from hcp.parallel.cp_sharding import CPShard, cp_shard, host_cu_seqlens

OWN_CP_GROUP = object()
"""`cp_group` default of `LlavaModel`'s methods: the model's own CP group."""


class LlavaEncoder(nn.Module):
    """The encoder side as its own module: vision + projector, pixel_values [I, C, H, W] ->
    image rows [I * P, H_llm] (images in order, P patches each), whole on every rank of
    `tp_group` (the encoder's TP group: ViT blocks and projector split over it).

    The output passes through Megatron's copy-to-tensor-parallel-region (identity forward,
    all-reduce of the gradient over `tp_group` backward): the boundary route sends each row
    from one TP replica only and returns its gradient there, so the all-reduce gives every
    replica the whole gradient. FQNs (`vision.*`, `projector.*`) equal `LlavaModel`'s, so
    `init_parameters(encoder, seed)` gives the same weights as the single-process model.

    `cp_group`: the encoder's CP group (`hcp.model.vit`): the output is then this CP rank's rows
    of each image [I * n_r, H_llm], which the route takes from every CP rank.

    Raises ValueError for an encoder layout with PP > 1 (encoder PP comes with non-colocated
    placement).
    """

    def __init__(self, vision_cfg: EncoderArch, projector_cfg: ProjectorArch, llm_hidden: int,
                 tp_group=None, cp_group=None):
        super().__init__()
        for name, layout in (("vision", vision_cfg.layout), ("projector", projector_cfg.layout)):
            if layout.pp != 1:
                raise ValueError(f"{name}.layout.pp={layout.pp}: the colocated encoder runs whole; "
                                 f"set {name}.layout.pp=1 (encoder pipelines: "
                                 f"placement=non_colocated)")
        self.tp_group = tp_group
        self.vision = build_encoder(vision_cfg, tp_group, cp_group=cp_group)
        self.projector = Projector(projector_cfg, vision_cfg.hidden_size, llm_hidden, tp_group)

    @property
    def num_patches(self) -> int:
        return self.vision.num_patches

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        feats = self.projector(self.vision(pixel_values))                # [I, P, H]
        return copy_to_group(feats.reshape(-1, feats.shape[-1]), self.tp_group)


class LlavaModel(nn.Module):
    def __init__(self, vision_cfg: EncoderArch | None, projector_cfg: ProjectorArch | None,
                 llm_cfg: LLMArch, tp_group=None, cp_group=None, cp_comm: str | None = None,
                 sequence_parallel: bool | None = None, stage: StageSpec | None = None,
                 recompute: str | None = None, encoder: bool = True, encoders: dict | None = None,
                 projectors: dict | None = None, streams=None,
                 attention_backend: str | None = None):
        """`encoder=False`: build no vision encoder and projector; image embeddings come routed
        in `batch.image_rows` (module docstring). `encoders` / `projectors`: named modules
        besides vision and projector (name -> EncoderArch / ProjectorArch); `streams`: the
        streams into the LLM (`hcp.config.modules.streams`; default: vision -> projector).
        `attention_backend`: the run's concrete backend (`hcp.model.llama.LlamaDecoder`).

        Raises ValueError when exactly one of vision_cfg / projector_cfg is given, or a stream
        names a module without a config."""
        super().__init__()
        if (vision_cfg is None) != (projector_cfg is None):
            raise ValueError("vision and projector must be given together (or both None for a "
                             "text-only LM)")
        first = (stage is None or stage.first) and encoder
        self.streams = (tuple(streams) if streams is not None else
                        DEFAULT_STREAMS if vision_cfg is not None else ())
        if first and vision_cfg is not None:
            add_encoder_modules(self, {"vision": vision_cfg, **(encoders or {})},
                                {"projector": projector_cfg, **(projectors or {})}, self.streams,
                                llm_cfg.hidden_size)
        else:
            self.vision = self.projector = None
        self.llm = LlamaDecoder(llm_cfg, tp_group, cp_group, cp_comm, sequence_parallel, stage,
                                recompute, attention_backend)
        self.stage = self.llm.stage
        self.tp_group, self.cp_group = tp_group, cp_group

    def embed(self, batch, shard: CPShard | None = None) -> torch.Tensor:
        """Text embeddings of this rank's tokens (the CP shard's slots, or all T) with every
        stream's rows written over its positions: [T_loc, H] (T without CP).

        A stream's rows: routed (`batch.image_rows` / `batch.stream_rows`, already this shard's,
        in slot order) when set, else this model's encoder over the stream encoder's inputs
        (each encoder runs once, whatever the number of streams it feeds).

        Routed rows are written without reading the device: their count R is their shape, the
        slots are the first R positions of the mask (`nonzero_static`), and a mismatch fails
        asynchronously (`torch._assert_async`: RuntimeError on CPU, a device assert on CUDA).

        Raises ValueError when the encoder's rows do not match its positions, or inputs reach a
        model without an encoder.
        """
        ids = batch.input_ids if shard is None else batch.input_ids[shard.token_index]
        embeds = self.llm.embed(ids)
        encoded: dict = {}
        # a text-only LM: image positions are an error
        for stream in self.streams or DEFAULT_STREAMS:
            mask = _mask(batch, stream.projector)
            if mask is None:
                continue
            local = mask if shard is None else mask[shard.token_index] & shard.valid
            rows = _routed(batch, stream.projector)
            if rows is None:
                rows, slots = self._encode(batch, stream, mask, shard, local, encoded)
            else:
                what = ("batch.image_rows" if stream.projector == "projector"
                        else f"batch.stream_rows[{stream.projector!r}]")
                torch._assert_async(local.sum() == rows.shape[0],
                                    f"{what} has {rows.shape[0]} rows but this rank's tokens hold "
                                    "another number of image positions: they must be equal")
                slots = torch.nonzero_static(local, size=rows.shape[0]).squeeze(1)
            if rows is not None:
                embeds = embeds.index_put((slots,), rows.to(embeds.dtype))
        return embeds

    def _encode(self, batch, stream, mask, shard, local, encoded: dict):
        """(this rank's rows [R, H] of `stream` from the micro-batch's inputs of its encoder,
        their slots among the positions `local` of this shard), or (None, None) when there
        are no inputs: then a position marked anyway fails asynchronously, as routed rows do
        (no device read for a text-only micro-batch). `encoded` caches each encoder's streams
        within one embed."""
        pixel_values = _inputs(batch, stream.encoder)
        if pixel_values is None or pixel_values.shape[0] == 0:
            what = "images" if stream.encoder == "vision" else f"{stream.encoder} inputs"
            marks = "image_mask" if stream.projector == "projector" else stream.projector
            torch._assert_async(mask.sum() == 0,
                                f"{marks} marks positions but the batch has no {what}")
            return None, None
        num_slots = int(mask.sum())
        slots = local.nonzero().squeeze(1)
        if getattr(self, stream.encoder, None) is None:
            raise ValueError("the batch has pixel_values but the model has no vision encoder "
                             "(built with encoder=False: pass the routed batch.image_rows)")
        if stream.encoder not in encoded:
            encoded[stream.encoder] = encode_streams(self, self.streams, stream.encoder,
                                                     pixel_values)
        feats = encoded[stream.encoder][stream.projector]                 # [I * R_s, H]
        if num_slots != feats.shape[0]:
            what = "image_mask" if stream.projector == "projector" else f"{stream.projector}'s mask"
            raise ValueError(f"{what} marks {num_slots} positions but {pixel_values.shape[0]} "
                             f"inputs of {stream.encoder} give {feats.shape[0]} rows of "
                             f"{stream.projector}: they must be equal")
        if shard is None:
            return feats, slots
        # each position's row in the whole sequence, read at this shard's slots of the stream
        row_of = torch.cumsum(mask.long(), 0) - 1
        return feats[row_of[shard.token_index[slots]]], slots

    def _cp(self, cp_group):
        """The CP group a caller passed (`OWN_CP_GROUP`: the model's own)."""
        return self.cp_group if cp_group is OWN_CP_GROUP else cp_group

    def _shard(self, batch, cp_group=OWN_CP_GROUP):
        """(this CP rank's shard or None, labels of its slots [T_loc] with padding -100)."""
        group = self._cp(cp_group)
        if group_size(group) == 1:
            return None, batch.labels
        shard = cp_shard(host_cu_seqlens(batch), group_size(group), group_rank(group),
                         batch.cu_seqlens.device)
        return shard, batch.labels[shard.token_index].masked_fill(~shard.valid, -100)

    def residual_shape(self, batch, cp_group=OWN_CP_GROUP) -> tuple[int, int]:
        """Shape [rows, H] of the residual stream `stage_forward` passes between stages for
        `batch` (a micro-batch or its `StageMeta`): this CP rank's T_loc tokens, under sequence
        parallelism padded to a multiple of tp and split over it. Lets a pipeline stage
        allocate a receive buffer before the activation arrives."""
        rows = self._shard(batch, cp_group)[1].shape[0]
        if self.llm.sequence_parallel:
            rows = (rows + self.llm._sp_pad(rows)) // group_size(self.tp_group)
        return rows, self.llm.cfg.hidden_size

    def stage_forward(self, batch, x: torch.Tensor | None = None,
                      cp_group=OWN_CP_GROUP) -> torch.Tensor:
        """This stage's part of the forward pass over one micro-batch.

        batch: the micro-batch (first stage) or its `StageMeta` (later stages); x: the previous
        stage's output (None on the first stage). Returns the residual stream [T_loc, H] (SP:
        [(T_loc + pad) / tp, H]) for the next stage, or on the last stage the final-normed
        hidden states [T_loc, H] (T_loc: this CP rank's tokens, T without CP).
        """
        shard, labels = self._shard(batch, cp_group)
        positions = batch.position_ids if shard is None else shard.position_ids
        if self.stage.first:
            x = self.llm.enter(self.embed(batch, shard))
        x = self.llm.run_layers(x, positions, batch.cu_seqlens, batch.max_seqlen,
                                cp_group=self._cp(cp_group),
                                seqlens=getattr(batch, "seqlens", None))
        return self.llm.exit(x, labels.shape[0]) if self.stage.last else x

    def loss(self, batch, hidden: torch.Tensor, cp_group=OWN_CP_GROUP) -> tuple[torch.Tensor, int]:
        """Last stage: (sum of token cross-entropies over labels != -100 of this rank's CP shard
        as a 0-d fp32 tensor, number of those tokens) from the final hidden states [T_loc, H].
        Without CP the count is the batch's host `loss_tokens` when known (an int), so the loss
        tokens are picked without reading the device (`nonzero_static`). Under CP the shard's
        count is not known on the host: its loss positions and as many more are scored as the
        micro-batch has loss tokens (a shard holds at most those; every position of the shard
        when fewer slots, or when the count is unknown), the ones past the shard's count masked
        out, and the count is a 0-d tensor (still no device read)."""
        shard, labels = self._shard(batch, cp_group)
        keep = labels != -100
        known = getattr(batch, "loss_tokens", None)
        if shard is None and known is not None:
            n, weight = known, None
            index = torch.nonzero_static(keep, size=n).squeeze(1)
        else:
            n = keep.sum()
            rows = keep.numel() if known is None else min(keep.numel(), known)
            index = torch.nonzero_static(keep, size=rows, fill_value=0).squeeze(1)
            weight = (torch.arange(rows, device=keep.device) < n).float()
        target = labels.index_select(0, index).clamp(min=0)  # masked slots: any valid id
        logits = self.llm.logits(hidden.index_select(0, index))
        if group_size(self.tp_group) == 1:
            per_token = F.cross_entropy(logits.float(), target, reduction="none")
        else:
            per_token = vocab_parallel_cross_entropy(logits, target, self.tp_group)
        loss_sum = (per_token * weight).sum() if weight is not None else per_token.sum()
        return loss_sum, n

    def forward(self, batch, x: torch.Tensor | None = None, head=None, cp_group=OWN_CP_GROUP):
        """This stage's forward (`stage_forward`) over the micro-batch's CP group `cp_group`;
        on the last stage finished by `head(batch, hidden)` (evaluation, the model's own
        group), by default `loss`: (loss sum, token count) of this rank's CP shard, not a mean
        (the trainer divides by the global token count). One entry point, so wrappers that
        hook `forward` (FSDP) see the whole stage."""
        out = self.stage_forward(batch, x, cp_group)
        if not self.stage.last:
            return out
        return head(batch, out) if head is not None else self.loss(batch, out, cp_group)

    def logits(self, batch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of every position [T, V], gathered over TP and CP (greedy decoding reads the
        last one of a document), from the last stage's hidden states (default: run the whole
        single-stage model)."""
        shard, _ = self._shard(batch)
        hidden = self.stage_forward(batch) if hidden is None else hidden
        logits = gather_from_group(self.llm.logits(hidden), self.tp_group)
        if shard is None:
            return logits
        group = self.cp_group
        c = group_size(group)
        host, device = host_cu_seqlens(batch), batch.cu_seqlens.device
        shards = [cp_shard(host, c, r, device) for r in range(c)]
        index = torch.cat([sh.token_index for sh in shards])
        valid = torch.cat([sh.valid for sh in shards])
        every = gather_seq(logits, group)                        # [c * T_loc, V]
        return every.new_zeros(batch.labels.shape[0], every.shape[1]).index_put(
            (index[valid],), every[valid])


def _mask(batch, projector: str):
    """Positions of `projector`'s stream in `batch` (bool [T]) or None."""
    if projector == "projector":
        return getattr(batch, "image_mask", None)
    return (getattr(batch, "stream_masks", None) or {}).get(projector)


def _routed(batch, projector: str):
    """Routed rows of `projector`'s stream for this rank ([R, H]) or None."""
    if projector == "projector":
        return getattr(batch, "image_rows", None)
    return (getattr(batch, "stream_rows", None) or {}).get(projector)


def _inputs(batch, encoder: str):
    """Inputs of `encoder` in `batch` ([I, C, H, W]) or None."""
    if encoder == "vision":
        return getattr(batch, "pixel_values", None)
    return (getattr(batch, "encoder_pixels", None) or {}).get(encoder)
