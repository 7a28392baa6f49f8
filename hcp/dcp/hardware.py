"""The hardware profile of the cost model (`hcp.dcp.cost_model`): peak rates, efficiencies,
bandwidths and overheads, loaded from a YAML (profiles/h100.yaml, or one fitted by
`mode=calibrate`) and validated field by field (`HARDWARE_RULES`)."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import numpy as np
import yaml

from hcp.config.errors import ConfigError

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
        elif f.type.startswith("dict"):
            typed, problem = v is None or isinstance(v, dict), "not a mapping"
        else:
            typed = (isinstance(v, (int, float, np.integer, np.floating))
                     and not isinstance(v, bool) and np.isfinite(v))
            problem = "not a finite number"
        if not typed or not test(v):
            raise ConfigError(f.name, v, "invalid value" if typed else problem, f"use {valid}")


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
    "cp_latency": _OVERHEAD,
    "cp_attention_efficiency": (
        lambda v: _per_cp_size(v, lambda e: 0 < e <= 1),
        "a mapping {CP size (a power of two >= 2): fraction of the peak in (0, 1]}, e.g. "
        "{2: 0.4, 4: 0.38}, or leave it out"),
    "cp_overhead": (
        lambda v: _per_cp_size(v, lambda e: e >= 0),
        "a mapping {CP size (a power of two >= 2): seconds >= 0}, e.g. {2: 1.0e-4, 4: 2.0e-4}, "
        "or leave it out"),
}


def _per_cp_size(v, valid) -> bool:
    """None, or {CP size: number}: sizes powers of two >= 2, numbers finite and `valid`."""
    return v is None or all(
        isinstance(c, (int, np.integer)) and not isinstance(c, bool) and _power_of_two(c) and c > 1
        and isinstance(e, (int, float, np.integer, np.floating)) and not isinstance(e, bool)
        and np.isfinite(e) and valid(e) for c, e in v.items())


def at_cp_size(mapping: dict | None, c) -> np.ndarray | None:
    """`mapping`'s value at each CP size of `c` (a size not listed: the largest listed below it,
    else the smallest listed), or None without a mapping."""
    if not mapping:
        return None
    sizes = sorted(mapping)
    c = np.asarray(c, dtype=np.float64)
    i = np.maximum(np.searchsorted(np.array(sizes, dtype=np.float64), c, side="right") - 1, 0)
    return np.array([mapping[x] for x in sizes], dtype=np.float64)[i]


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
    cp_latency: float = 0.0
    """Seconds per ring step of a CP collective per layer (forward); optional in a YAML."""
    cp_attention_efficiency: dict | None = field(default=None, hash=False)
    """{CP size c >= 2: attention efficiency at c}: CP attention (hcp/model/cp_attention.py)
    runs other kernels than the fused SDPA of c = 1 (`attention_efficiency`). A size not listed
    takes the largest listed size below it (the smallest listed when none is); None (profiles
    before it): `attention_efficiency` at every c. Optional in a YAML."""
    cp_overhead: dict | None = field(default=None, hash=False)
    """{CP size c >= 2: forward seconds per layer that a micro-batch on a group of c pays once,
    whatever its tokens}: CP attention's per-call work (kernel calls, row gathers, the merge)
    and the collectives' set-up, which a micro-batch of a few short documents pays in full.
    Sizes not listed as in `cp_attention_efficiency`; None (profiles before it): 0. Added to
    the `cp_latency` ring steps. Optional in a YAML."""

    def __post_init__(self):
        check_fields(self, HARDWARE_RULES)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "HardwareProfile":
        """Load a profile; every field of the class must be present, unknown keys are errors
        (a `fit:` entry, the calibration's report, and a `host:` entry are ignored)."""
        data = dict(read_profile(path))
        data.pop("fit", None)
        data.pop("host", None)  # CPU ranks sharing cores: hcp.preflight.auto_host.Host
        return _from_mapping(cls, data, path)


def read_profile(path: str | Path) -> dict:
    """The top-level mapping of a profile YAML; ValueError naming the file otherwise."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)  # one line, not PyYAML's multi-line report
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{path}: not valid YAML{where} "
                         f"({getattr(err, 'problem', None) or type(err).__name__})") from None
    if not isinstance(data, dict):
        what = "the file is empty" if data is None else f"the top level is a {type(data).__name__}"
        raise ValueError(f"{path}: {what}; it must be a mapping of HardwareProfile keys like "
                         f"{PROFILES / 'h100.yaml'}")
    return data


def _from_mapping(cls, data, path):
    """`cls(**data)`, every error a ValueError naming the file, the key and the value."""
    names = [f.name for f in fields(cls)]
    required = [f.name for f in fields(cls) if f.default is MISSING]
    missing, extra = set(required) - set(data), set(data) - set(names)
    if missing or extra:
        raise ValueError(f"{path}: missing keys {sorted(missing)}, unknown keys {sorted(extra)}. "
                         f"Fix: give exactly {names}")
    # PyYAML reads `989e12` (no dot, no exponent sign) as a string: parse such strings as floats.
    floats = {f.name for f in fields(cls) if f.type == "float"}
    try:
        return cls(**{k: _yaml_float(v) if k in floats else v for k, v in data.items()})
    except ConfigError as err:
        raise ValueError(f"{path}: {err}") from None


def _yaml_float(v):
    try:
        return float(v) if isinstance(v, str) else v
    except ValueError:
        return v  # check_fields names it


def load_profile(spec: str | Path) -> HardwareProfile:
    """`h100` (the shipped analytic defaults, profiles/h100.yaml) or a profile YAML file (e.g.
    one written by `mode=calibrate`); ValueError naming the file otherwise."""
    path = PROFILES / "h100.yaml" if str(spec) == "h100" else Path(spec)
    if not path.is_file():
        raise ValueError(f"cost profile {spec!r}: neither 'h100' nor an existing YAML file")
    return HardwareProfile.from_yaml(path)
