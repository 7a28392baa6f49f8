"""Cost model: time of a packed group of sequences on `c` CP ranks, per pipeline stage.

FLOPs per transformer layer, forward, for a group of documents of lengths `L_i` (T = sum L_i
tokens), following Megatron-LM's per-layer count (`num_floating_point_operations` in
`megatron/training/training.py`) with the causal attention term made ragged:
    matmuls   2 * T * P_layer,  P_layer = 2 h^2 + 2 h d_kv + 3 h f  (Q, O; K, V; SwiGLU)
              (= Megatron's 4 T h (h + h g / n) + 6 T h f, g KV heads of n, d_kv = h g / n)
    attention 2 * h * sum_i L_i^2  (QK^T and AV, each 2 L^2 h halved by the causal mask)
and the LM head `2 T h V` on the last stage. Under CP of size c every rank holds T / c tokens
(zigzag chunks balance the causal work) so compute divides by c. Ring attention moves each
rank's K and V shards to the c - 1 others: `T (c - 1) / c * 2 d_kv * bytes` per rank and layer
over NVLink (c <= ranks_per_node) or InfiniBand (above). A fraction `comm_overlap` of it can
hide behind the attention kernels (ring attention overlaps block transfers with block compute;
FlexSP and ByteScale model CP time the same way: `(a L^2 + b L) / c + comm`), never more
than the attention time itself:  exposed = max((1 - overlap) * comm, comm - attention).
Backward is twice the forward (compute and K/V plus dK/dV traffic), full recompute adds one
forward: `bwd = (2 + recompute) * fwd`. Each micro-batch also pays a fixed overhead per stage.

All times are seconds, FLOPs are floating-point operations, bytes are bytes, tokens are tokens.
Arrays broadcast: `tokens`, `sq` (sum of squared lengths, tokens^2) and `c` of one shape S give
results of shape `[pp, *S]`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import yaml

from hcp.config.errors import ConfigError
from hcp.dcp.plan import Plan

PROFILES = Path(__file__).parent / "profiles"


def _positive(v) -> bool:
    return v > 0


def _power_of_two(v) -> bool:
    return v >= 1 and not v & (v - 1)


def check_fields(obj, rules: dict) -> None:
    """Raise ConfigError naming the field and value unless every field of the dataclass `obj`
    has its declared type (`int` fields a true integer: 8.9 is not 8; `float` fields a finite
    number) and passes `rules[name] = (test, what a valid value is)`."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        test, valid = rules[f.name]
        if f.type == "int":
            typed = isinstance(v, (int, np.integer)) and not isinstance(v, bool)
            problem = "not an integer"
        else:
            typed = (isinstance(v, (int, float, np.integer, np.floating))
                     and not isinstance(v, bool) and np.isfinite(v))
            problem = "not a finite number"
        if not typed or not test(v):
            raise ConfigError(f.name, v, "invalid value" if typed else problem, f"use {valid}")


@dataclass(frozen=True)
class ModelSpec:
    """Decoder shape: layers, hidden h, attention heads n, KV heads g, SwiGLU FFN f, vocab V."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    def __post_init__(self):
        check_fields(self, {f.name: (_positive, "a positive integer") for f in fields(self)})
        if self.heads % self.kv_heads:
            raise ConfigError("kv_heads", self.kv_heads, f"does not divide heads={self.heads}",
                              "use a divisor of heads (grouped-query attention)")

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V) per token: `h * g / n`."""
        return self.hidden * self.kv_heads // self.heads

    @property
    def layer_params(self) -> int:
        """Matmul weights of one layer, `P_layer` (norms ignored)."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.ffn


LLAMA_13B = ModelSpec(layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000)

_FRACTION = (lambda v: 0 < v <= 1, "a fraction of the peak in (0, 1]")
_BANDWIDTH = (_positive, "a positive bandwidth in bytes/s, e.g. 40.0e+9")
_OVERHEAD = (lambda v: v >= 0, "seconds >= 0, e.g. 1.0e-3")
HARDWARE_RULES = {
    "peak_flops": (_positive, "a positive rate in FLOP/s, e.g. 989.0e+12"),
    "matmul_efficiency": _FRACTION,
    "attention_efficiency": _FRACTION,
    "nvlink_bandwidth": _BANDWIDTH,
    "ib_bandwidth": _BANDWIDTH,
    "ranks_per_node": (_power_of_two, "a power of two (aligned CP blocks must not straddle "
                                      "nodes), e.g. 8"),
    "comm_overlap": (lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
    "micro_batch_overhead_fwd": _OVERHEAD,
    "micro_batch_overhead_bwd": _OVERHEAD,
    "bytes_per_element": (_positive, "a positive integer number of bytes, e.g. 2 (BF16)"),
}


@dataclass(frozen=True)
class HardwareProfile:
    """Peak rates, efficiencies, bandwidths (bytes/s) and overheads (s): see profiles/h100.yaml;
    valid values: HARDWARE_RULES."""

    peak_flops: float
    matmul_efficiency: float
    attention_efficiency: float
    nvlink_bandwidth: float
    ib_bandwidth: float
    ranks_per_node: int
    comm_overlap: float
    micro_batch_overhead_fwd: float
    micro_batch_overhead_bwd: float
    bytes_per_element: int

    def __post_init__(self):
        check_fields(self, HARDWARE_RULES)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "HardwareProfile":
        """Load a profile; every field of the class must be present (unknown keys are errors,
        an optional `model:` entry is load_cost's)."""
        data = dict(read_profile(path))
        data.pop("model", None)
        return _from_mapping(cls, data, path)


def read_profile(path: str | Path) -> dict:
    """The top-level mapping of a profile YAML; ValueError naming the file otherwise."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(data, dict):
        what = "the file is empty" if data is None else f"the top level is a {type(data).__name__}"
        raise ValueError(f"{path}: {what}; it must be a mapping of HardwareProfile keys like "
                         f"{PROFILES / 'h100.yaml'}")
    return data


def _from_mapping(cls, data, path, key: str = ""):
    """`cls(**data)`, every error a ValueError naming the file, the key (nested under `key`,
    e.g. "model") and the value."""
    names = [f.name for f in fields(cls)]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {key}={data!r} is not a mapping. Fix: give all of {names}")
    missing, extra = set(names) - set(data), set(data) - set(names)
    if missing or extra:
        raise ValueError(f"{path}: {key + ': ' if key else ''}missing keys {sorted(missing)}, "
                         f"unknown keys {sorted(extra)}. Fix: give exactly {names}")
    # PyYAML reads `989e12` (no dot, no exponent sign) as a string: parse such strings as floats.
    floats = {f.name for f in fields(cls) if f.type == "float"}
    try:
        return cls(**{k: _yaml_float(v) if k in floats else v for k, v in data.items()})
    except ConfigError as err:
        raise ValueError(f"{path}: {key + '.' if key else ''}{err}") from None


def _yaml_float(v):
    try:
        return float(v) if isinstance(v, str) else v
    except ValueError:
        return v  # check_fields names it


class CostModel:
    """Per-stage forward/backward time of packed groups for a model split over `pp` stages.

    Layers are split as evenly as possible (earlier stages take the remainder); the last stage
    also runs the LM head. `recompute=True` is full activation recompute (the seed's setting).
    """

    def __init__(self, model: ModelSpec, hw: HardwareProfile, pp: int = 1, recompute: bool = True):
        if pp < 1 or pp > model.layers:
            raise ConfigError("pp", pp, f"every stage needs one of the {model.layers} layers",
                              f"use 1 <= pp <= {model.layers}")
        self.model, self.hw, self.pp, self.recompute = model, hw, pp, recompute
        n = np.full(pp, model.layers // pp, dtype=np.float64)
        n[: model.layers % pp] += 1
        head = np.zeros(pp)
        head[-1] = 1.0
        h = model.hidden
        mm_flops = n * 2 * model.layer_params + head * 2 * h * model.vocab  # FLOPs / token
        self.mm_coef = mm_flops / (hw.peak_flops * hw.matmul_efficiency)  # s / token
        self.attn_coef = n * 2 * h / (hw.peak_flops * hw.attention_efficiency)  # s / token^2
        self.comm_coef = n * 2 * model.kv_dim * hw.bytes_per_element  # bytes / token
        self.bwd_factor = 2.0 + float(recompute)

    def _parts(self, tokens, sq, c):
        t, s, c = (np.asarray(x, dtype=np.float64) for x in (tokens, sq, c))
        col = (slice(None),) + (None,) * t.ndim
        compute = (self.mm_coef[col] * t + self.attn_coef[col] * s) / c
        attn = self.attn_coef[col] * s / c
        bw = np.where(c <= self.hw.ranks_per_node, self.hw.nvlink_bandwidth, self.hw.ib_bandwidth)
        comm = self.comm_coef[col] * t * (c - 1) / c / bw
        return compute, attn, comm

    def fwd(self, tokens, sq, c) -> np.ndarray:
        """Forward seconds `[pp, *S]` of groups with `tokens`, `sq` on `c` ranks (no overhead)."""
        compute, attn, comm = self._parts(tokens, sq, c)
        exposed = np.maximum((1.0 - self.hw.comm_overlap) * comm, comm - attn)
        return compute + exposed

    def fwd_floor(self, tokens, sq, c) -> np.ndarray:
        """Additive lower envelope of `fwd`: compute + (1 - overlap) * comm, `[pp, *S]` seconds.

        `fwd(group) >= sum over its sequences of fwd_floor(L_i, L_i^2, c)`: every term is linear
        in (tokens, sq) and the exposed communication is never below `(1 - overlap) * comm`.
        """
        compute, _, comm = self._parts(tokens, sq, c)
        return compute + (1.0 - self.hw.comm_overlap) * comm

    def model_flops(self, lengths) -> float:
        """Model FLOPs of one training step on these sequences: 3 x forward (recompute not
        counted), ragged causal attention `2 h sum L^2` per layer, LM head included."""
        arr = np.asarray(lengths, dtype=np.float64)
        m, t, s = self.model, arr.sum(), (arr**2).sum()
        fwd = m.layers * (2 * m.layer_params * t + 2 * m.hidden * s) + 2 * m.hidden * m.vocab * t
        return 3.0 * fwd

    def stage_times(self, plan: Plan, lengths) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward seconds `[pp, M]` of each micro-batch on each stage: the slowest
        group of the micro-batch (the pool synchronizes per micro-batch) plus the overhead."""
        arr = np.asarray(lengths, dtype=np.float64)
        members, cs, mbs = [], [], []
        for j, mb in enumerate(plan.micro_batches):
            for g in mb.groups:
                if g.seq_indices:
                    members.append(g.seq_indices)
                    cs.append(g.cp_size)
                    mbs.append(j)
        sizes = np.fromiter(map(len, members), dtype=np.int64, count=len(members))
        seqs = np.fromiter((i for idx in members for i in idx), dtype=np.int64, count=sizes.sum())
        gid = np.repeat(np.arange(len(members)), sizes)
        x = arr[seqs]
        tok = np.bincount(gid, weights=x, minlength=len(members))
        sq = np.bincount(gid, weights=x * x, minlength=len(members))
        f = self.fwd(tok, sq, np.array(cs))  # [pp, G]
        worst = np.zeros((self.pp, plan.num_micro_batches))
        np.maximum.at(worst, (slice(None), np.array(mbs)), f)
        return (worst + self.hw.micro_batch_overhead_fwd,
                worst * self.bwd_factor + self.hw.micro_batch_overhead_bwd)


def load_profile(spec: str) -> tuple[ModelSpec, HardwareProfile]:
    """`h100-llama13b` (shipped defaults) or a YAML file of HardwareProfile keys with an
    optional `model:` mapping of all ModelSpec fields (default LLaMA-13B)."""
    path = PROFILES / "h100.yaml" if spec == "h100-llama13b" else Path(spec)
    if not path.is_file():
        raise ValueError(f"--cost {spec!r}: neither 'h100-llama13b' nor an existing YAML file")
    data = read_profile(path)
    model = _from_mapping(ModelSpec, data["model"], path, "model") if "model" in data else LLAMA_13B
    return model, HardwareProfile.from_yaml(path)


def load_cost(spec: str, pp: int, recompute: bool = True) -> CostModel:
    """The cost model of `load_profile(spec)` split over `pp` stages."""
    return CostModel(*load_profile(spec), pp=pp, recompute=recompute)
