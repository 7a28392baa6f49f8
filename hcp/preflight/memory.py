"""Per-rank memory estimate of a layout, in bytes (plan mode).

Bytes come from the run's precision policy (`hcp.config.precision.Precision`), the one the
schedules, routes and links run. Model state per trained parameter (Adam, no distributed
optimizer; `Precision.state_bytes`): fp32 weights 4 B (the master copy: parameters stay fp32,
autocast casts per op) + fp32 gradients 4 B + two fp32 Adam moments 8 B = 16 B, under `bf16`
and `fp32` alike. A frozen module keeps its weights only (4 B). `layout.dp_shard` (FSDP2)
divides a module's state by dp*cp and adds what FSDP holds beyond the shards (`fsdp_bytes`, as
torch 2.13's `_fully_shard` runs it; docs/memory.md): in `weights`, the all-gathered
parameters: the LLM root's whole (embeddings, final norm, output layer: not resharded after
its forward, in the parameter dtype) and two layer units' (the one computing and the one
prefetched, in the compute dtype: `Precision.fsdp_policy`); in `grads`, one unit's whole
gradients in flight (4 B each: the fp32 reduce-scatter input), and under
`trainer.fsdp_reduce=per_step` with several backward passes per step every parameter's whole
fp32 gradient instead of the shard (FSDP accumulates unsharded until the last backward). A
`dp_shard` layer keeps no autocast weight copy (it gathers in the compute dtype).

Where parameters sit: a module's numbered layers (`layers.{i}` / `blocks.{i}`) go to their PP
stage per `pp_layers`; parameters registered before the first layer (token embedding, patch and
position embeddings) sit on the first stage, those after it (final norm, output layer) on the last.
TP splits the 2-D weights of the layers and the projector and the vocabulary-sized tables
(vocab-parallel embedding and output layer); norms, biases, patch/position embeddings and the
CLS token are replicated.

Activations per rank (`trainer.micro_batch_tokens` = T tokens per rank and micro-batch, already
CP-sharded), per layer and token, for hidden h, KV width h_kv, FFN f, TP t (flash-style
attention: no T^2 score matrix is stored). Elements computed under autocast take the compute
dtype's bytes (`Precision.act_bytes`: 2 B in bf16, 4 B in fp32); the residual stream stays in
the parameter dtype under autocast (`Precision.residual_bytes`: 4 B), so the norm inputs and a
recomputed layer's input are charged 4 B in bf16 too. What a layer saves for its backward, as
`hcp.model.llama.DecoderLayer` runs (tests/test_plan_memory.py measures it):
- LLM `none` = `selective` (the recomputed attention core keeps nothing beyond its output):
  4h at the stream's bytes (each RMSNorm's fp32 input and normalized output; divided by t
  under sequence parallelism) + 5h (q/k/v/gate/up each keep their own compute-dtype cast of
  their full input; 2h, the two norm outputs, without autocast or sequence parallelism) +
  (2h + 2h_kv + 4f)/t (q, k, v, attention output; SwiGLU's gate, up, silu and product);
  under autocast also every matrix's compute-dtype copy per micro-batch in flight
  (`weight_copy_bytes`; the output layer's on the last stage);
- ViT `none`: 2h at the stream's bytes (the two LayerNorm inputs; divided by t under sequence
  parallelism) + 4h (q/k/v/fc1 each keep their own compute-dtype cast of their full input; 2h,
  the two norm outputs, without autocast or sequence parallelism) + (2h + 2h_kv + 2f)/t (q, k,
  v, attention output, fc1's output and the GELU's; quick-GELU (`arch: clip`) keeps its
  sigmoid too, one more f); `selective` drops the attention output h and one f; under autocast
  also every matrix's compute-dtype copy, as the LLM's;
- `full`: only the layer input, h (divided by t under sequence parallelism), plus one layer's
  `none` activations (and weight copies) while it is recomputed.
Under 1F1B, stage s holds pp - s micro-batches in flight (fewer when a step has fewer: a
rehearsal's small batch, `module_memory`'s `micro_batches`). The LLM's last stage adds fp32 logits
(T x vocab/t x 4 B). An LLM under CP c > 1 adds the buffers of one layer's CP attention backward
(`cp_attention_bytes`, `hcp.model.cp_attention`), c the largest CP size a micro-batch may take
(under `packing=dynamic_cp` the largest power of two dividing the pool dp*cp). The projector stores
(its input width + 2h/t) per token. A module stores activations only when gradients flow through it
(it or a module upstream trains).

Encoder-side modules (every module but the LLM) run image tokens, not `micro_batch_tokens`
(`encoder_activation_tokens`): an encoder lane encodes I = global_batch / dp *
`data.images_per_sample` images per step, each of (image_size / patch_size)^2 patches (+ 1 CLS token
in the ViT):
- `colocated` (the three-phase schedule, `hcp.schedule.colocated`): phase 1 encodes all I images
  at once and their activations stay alive through the LLM's phase 2 until phase 3. Under
  `vision.layout.recompute=full` phase 1 keeps nothing and phase 3 recomputes the whole encoder
  over the I images: the same `none` activations and every layer's weight copies, but only while
  the LLM's are freed, so a rank holds max(LLM + other activations, these) (`StageMemory.held`
  False);
- `non_colocated` (graph-aware 1F1B): per micro-batch a lane encodes its images of that
  micro-batch, at most n = min(I, llm micro_batch_tokens * cp // patches), the images whose
  tokens fill one LLM micro-batch (reached under the step plan's block lanes, where one encoder
  lane feeds a whole LLM micro-batch); the island acts as stages before the LLM's first stage,
  so encoder stage s holds min(ceil(I / n), pp - s + llm pp) micro-batches in flight.
Encoder CP c (`<encoder>.layout.cp`, `hcp.parallel.encoder_cp`): a rank holds ceil((patches + 1)
/ c) tokens of each of its lane's I images (its projector ceil(rows / c) rows), and each ViT
layer keeps the all-gathered K/V of the whole images for its backward: (c - 1) * 2h/t more
elements per local token and layer than the `none` count (recomputed under `full`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from hcp.config.precision import Precision
from hcp.parallel import encoder_cp

GIB = 2**30
_LAYER = re.compile(r"^(?:layers|blocks)\.(\d+)\.")


@dataclass(frozen=True)
class StageMemory:
    """Bytes one rank of a module's PP stage holds."""

    params: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    held: bool = True
    """False: the activations live only outside the LLM's phase (the colocated encoder's phase-3
    recompute), never at the same time as the held ones (`rank_activations`)."""

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations


def _placed(named_shapes: list[tuple[str, tuple[int, ...]]], layout, vocab_size: int | None):
    """(PP stage, layer index or None for the stage's other parameters, elements on one rank
    after TP) of each parameter of a module (module docstring: where parameters sit)."""
    bounds, total = [], 0
    for n in layout.pp_layers:
        total += n
        bounds.append(total)
    seen_layer = False
    for name, shape in named_shapes:
        numel = math.prod(shape)
        match = _LAYER.match(name)
        if match:
            seen_layer, layer = True, int(match.group(1))
            stage = next(s for s, b in enumerate(bounds) if layer < b)
            split = len(shape) >= 2
        else:
            stage, layer = (layout.pp - 1 if seen_layer else 0), None
            split = (vocab_size in shape) or (layout.module == "projector" and len(shape) >= 2)
        yield stage, layer, numel // layout.tp if split else numel


def stage_params(named_shapes: list[tuple[str, tuple[int, ...]]], layout,
                 vocab_size: int | None) -> list[int]:
    """Parameters held by one rank of each PP stage (after TP), from a module's named shapes
    (names relative to the module, in registration order)."""
    counts = [0] * layout.pp
    for stage, _, numel in _placed(named_shapes, layout, vocab_size):
        counts[stage] += numel
    return counts


def fsdp_units(named_shapes, layout, vocab_size: int | None) -> list[tuple[int, int, int]]:
    """(largest FSDP unit's parameters, the root's parameters, layers) on one rank of each PP
    stage (after TP): `hcp.train.fsdp` makes each numbered layer a unit and the rest of the
    stage's parameters the root (a module without layers, the projector: its root alone)."""
    layers: list[dict] = [{} for _ in range(layout.pp)]
    roots = [0] * layout.pp
    for stage, layer, numel in _placed(named_shapes, layout, vocab_size):
        if layer is None:
            roots[stage] += numel
        else:
            layers[stage][layer] = layers[stage].get(layer, 0) + numel
    return [(max(u.values(), default=0), root, len(u)) for u, root in zip(layers, roots)]


def fsdp_bytes(cfg, layout, units: tuple[int, int, int], params: int, accumulates: bool,
               trained: bool) -> tuple[int, int]:
    """(weights, gradients) bytes FSDP2 holds on one rank of a PP stage beyond the shards
    (module docstring, FSDP). `units`: the stage's `fsdp_units`; `params`: its parameters on
    one rank (after TP); `accumulates`: a step runs several backward passes of the module;
    `trained`: it has gradients."""
    precision = Precision.of(cfg.precision)
    reduce = precision.fsdp_reduce_bytes
    unit, root, layers = units
    gather = precision.fsdp_param_bytes if layers else reduce  # a root: in the parameter dtype
    unit = unit if layers else root
    held_root = root * reduce if layout.module == "llm" else 0  # not resharded after its forward
    weights = held_root + min(2, max(layers, 1)) * unit * gather
    if not trained:
        return weights, 0
    in_flight = unit * reduce  # its gradients, or their fp32 reduce-scatter input
    whole = 0
    if accumulates and cfg.trainer.fsdp_reduce == "per_step":
        whole = params * reduce - params * precision.state_bytes["grads"] // (layout.dp * layout.cp)
    return weights, in_flight + whole


def layer_bytes(h: int, h_kv: int, f: int, gated: bool, layout, precision: Precision,
                quick_gelu: bool = False) -> dict[str, float]:
    """Activation bytes per token and layer under each recompute mode (module docstring): a
    LLaMA decoder layer (`gated`) or a ViT block (`quick_gelu`: its MLP's activation is
    quick-GELU, which keeps one more f); the residual stream's elements at
    `precision.residual_bytes`, the rest at `precision.act_bytes`."""
    t, sp = layout.tp, layout.sequence_parallel
    rest, stream = precision.act_bytes, precision.residual_bytes
    full = h * stream / (t if sp else 1)
    if gated:
        copies = 5 if precision.mixed or sp else 2
        none = (4 * h * stream / (t if sp else 1) + copies * h * rest
                + (2 * h + 2 * h_kv + 4 * f) * rest / t)
        return {"none": none, "selective": none, "full": full}
    copies = 4 if precision.mixed or sp else 2
    none = (2 * h * stream / (t if sp else 1) + copies * h * rest
            + (2 * h + 2 * h_kv + (3 if quick_gelu else 2) * f) * rest / t)
    return {"none": none, "selective": none - (h + f) * rest / t, "full": full}


def weight_copy_bytes(h: int, h_kv: int, f: int, layout, precision: Precision,
                      gated: bool = True) -> float:
    """Bytes of one layer's compute-dtype weight copies on a rank, a LLaMA decoder layer
    (`gated`: three FFN matrices) or a ViT block (two): autocast casts each matrix once per
    forward and the matmul keeps its copy for the backward. 0 without autocast."""
    if not precision.mixed:
        return 0.0
    return ((2 * h * h + 2 * h * h_kv + (3 if gated else 2) * h * f) / layout.tp
            * precision.act_bytes)


def encoder_activation_tokens(cfg, specs, layout, stage: int, layouts: dict) -> tuple[float, int]:
    """(tokens per rank whose activations an encoder-side module's `stage` keeps per micro-batch,
    micro-batches in flight), module docstring; `specs`: the run's `ModuleSpecs`."""
    spec = specs[layout.module]
    enc = specs[spec.source].arch if spec.kind == "projector" else spec.arch
    patches = (enc.image_size // enc.patch_size) ** 2
    if spec.kind == "projector":  # one row per (pooled) patch
        per_image = -(-(enc.image_size // enc.patch_size // spec.pool) ** 2 // layout.cp)
    else:
        per_image = encoder_cp.chunk(patches + encoder_cp.LEAD, layout.cp)  # + CLS, this CP rank's
    images, per_micro = _lane_images(cfg, layout, layouts, patches)
    if cfg.placement != "non_colocated":
        return images * per_image, 1
    in_flight = min(math.ceil(images / per_micro), layout.pp - stage + layouts["llm"].pp)
    return per_micro * per_image, in_flight


def _lane_images(cfg, layout, layouts: dict, patches: int) -> tuple[float, float]:
    """(images an encoder lane encodes per step, those of one micro-batch under `non_colocated`:
    the images whose `patches` each fill one LLM micro-batch), module docstring."""
    images = cfg.trainer.global_batch_size / layout.dp * float(cfg.data.images_per_sample)
    llm = layouts["llm"]
    return images, min(images, max(1, cfg.trainer.micro_batch_tokens * llm.cp // patches))


def _activations(cfg, specs, layout, stage: int, layouts=None, micro_batches=None) -> float:
    """Activation bytes of one rank of `stage` (`micro_batches`: `module_memory`'s)."""
    tokens, precision = cfg.trainer.micro_batch_tokens, Precision.of(cfg.precision)
    m = layout.module
    in_flight = (layout.pp - stage
                 if micro_batches is None else min(layout.pp - stage, micro_batches))
    if m != "llm" and layouts is not None:
        tokens, in_flight = encoder_activation_tokens(cfg, specs, layout, stage, layouts)
    if specs[m].kind == "projector":  # fed by its one encoder (hcp.config.modules)
        return (in_flight * tokens
                * (specs[specs[m].source].hidden_size + 2 * specs.llm.hidden_size / layout.tp)
                * precision.act_bytes)
    c, llm = specs[m].arch, m == "llm"
    h_kv = c.hidden_size * c.num_kv_heads // c.num_heads if llm else c.hidden_size
    per_token = layer_bytes(c.hidden_size, h_kv, c.ffn_hidden_size, llm, layout, precision,
                            quick_gelu=not llm and c.arch == "clip")
    copies = (0.0 if layout.dp_shard else  # FSDP gathers a layer's weights in the compute dtype
              weight_copy_bytes(c.hidden_size, h_kv, c.ffn_hidden_size, layout, precision, llm))
    if not llm and layout.cp > 1:  # encoder CP: the all-gathered K/V of whole images
        gathered = (layout.cp - 1) * 2 * h_kv * precision.act_bytes / layout.tp
        per_token = {k: v + (gathered if k != "full" else 0) for k, v in per_token.items()}
    layers = layout.pp_layers[stage]
    if _phase3_recompute(cfg, layout, layouts):  # the whole encoder side at once, its copies too
        return layers * (tokens * per_token["none"] + copies)
    total = in_flight * layers * tokens * per_token[layout.recompute]
    if layout.recompute == "full":
        total += tokens * per_token["none"]
    total += copies * (1 if layout.recompute == "full" else in_flight * layers)
    if llm:
        total += cp_attention_bytes(h_kv, tokens, _largest_cp(cfg, layout), layout, precision)
        if stage == layout.pp - 1:  # fp32 logits and the output layer's copy
            total += tokens * c.vocab_size / layout.tp * 4 + (c.vocab_size * c.hidden_size
                                                              / layout.tp
                                                              * precision.act_bytes
                                                              * precision.mixed)
    return total


def _largest_cp(cfg, layout) -> int:
    """The largest CP size an LLM micro-batch may take: `layout.cp`, or under
    `packing=dynamic_cp` the largest power of two dividing the pool dp*cp."""
    if cfg.packing != "dynamic_cp":
        return layout.cp
    pool = layout.dp * layout.cp
    return pool & -pool


def cp_attention_bytes(h_kv: int, tokens: float, cp: int, layout, precision: Precision) -> float:
    """Bytes of one layer's CP attention backward on a rank holding `tokens` of a CP-`cp`
    micro-batch (0 when cp is 1). `allgather`: over the group's cp * tokens gathered rows, the
    gathered K/V, the index copy of a call's rows and the K/V gradient cast for the
    reduce-scatter (compute dtype each) and the fp32 dK/dV accumulator: 2 h_kv / t
    (3 act_bytes + 4) per gathered row. `p2p`: the same over the two shards in flight
    (own and received), 2 * tokens rows."""
    if cp <= 1:
        return 0.0
    rows = cp * tokens if layout.cp_comm == "allgather" else 2 * tokens
    return rows * 2 * h_kv / layout.tp * (3 * precision.act_bytes + 4)


def _phase3_recompute(cfg, layout, layouts) -> bool:
    """Whether the module is a colocated encoder side under `vision.layout.recompute=full` (the
    three-phase schedule recomputes the whole encoder side in phase 3)."""
    return (layouts is not None and layout.module != "llm" and cfg.placement != "non_colocated"
            and cfg.vision is not None and cfg.vision.layout.recompute == "full")


def rank_activations(parts) -> int:
    """Activation bytes of one rank holding the `StageMemory` parts: the held ones together, or
    the phase-3-only ones together, whichever is larger."""
    held = sum(p.activations for p in parts if p.held)
    return max(held, sum(p.activations for p in parts if not p.held))


def _needs_grad(specs, module: str) -> bool:
    """Whether gradients flow through `module`: it or a module upstream of it trains."""
    if not specs[module].freeze:
        return True
    return any(_needs_grad(specs, src) for src, dst in specs.edges if dst == module)


def module_memory(cfg, specs, layout, named_shapes, layouts=None, params=None,
                  micro_batches: float | None = None, units=None) -> list[StageMemory]:
    """Memory of one rank of each PP stage of a module (`specs`: the run's `ModuleSpecs`, whose
    arch, freeze and edges it reads; its layouts are not used). `layouts` (all resolved layouts)
    gives encoder-side modules their image tokens (`encoder_activation_tokens`); without it they are
    charged `trainer.micro_batch_tokens` like the LLM (the estimate before issue 14). `params`:
    `stage_params`' result when known (a layout search computes it once per tp and split).
    `micro_batches`: the LLM micro-batches' worth of tokens a step gives each lane when known (a
    rehearsal's small batch may fill fewer than the pp - s that 1F1B's warm-up holds at full
    size, its last one partly; fractional); None: enough. `units`: `fsdp_units`' result when
    known (`dp_shard` only)."""
    vocab = cfg.llm.vocab_size if layout.module == "llm" else None
    state = Precision.of(cfg.precision).state_bytes
    shard = layout.dp * layout.cp if layout.dp_shard else 1
    trained = not specs[layout.module].freeze
    if layout.dp_shard:
        units = units if units is not None else fsdp_units(named_shapes, layout, vocab)
        accumulates = _accumulates(cfg, specs, layout, layouts, micro_batches)
    stages = []
    for s, params in enumerate(params if params is not None
                               else stage_params(named_shapes, layout, vocab)):
        acts = (_activations(cfg, specs, layout, s, layouts, micro_batches)
                if _needs_grad(specs, layout.module) else 0)
        gathered, in_flight = (fsdp_bytes(cfg, layout, units[s], params, accumulates, trained)
                               if layout.dp_shard else (0, 0))
        stages.append(StageMemory(params, params * state["weights"] // shard + gathered,
                                  params * state["grads"] // shard + in_flight if trained else 0,
                                  params * state["optimizer"] // shard if trained else 0, int(acts),
                                  not _phase3_recompute(cfg, layout, layouts)))
    return stages


def _accumulates(cfg, specs, layout, layouts, micro_batches) -> bool:
    """Whether a step runs several backward passes of the module: the LLM's micro-batches
    (`micro_batches`: `module_memory`'s; None: a full-size step, several), an encoder island's
    (`non_colocated`: one per LLM micro-batch's images); a colocated encoder side encodes a
    step's images at once (`encoder_activation_tokens`)."""
    if layout.module == "llm":
        return micro_batches is None or micro_batches > 1
    if layouts is None or cfg.placement != "non_colocated":
        return False
    spec = specs[layout.module]
    enc = specs[spec.source].arch if spec.kind == "projector" else spec.arch
    images, per_micro = _lane_images(cfg, layout, layouts, (enc.image_size // enc.patch_size) ** 2)
    return images > per_micro
