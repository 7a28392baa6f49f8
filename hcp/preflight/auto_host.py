"""Plain helpers of `layout=auto`'s estimate (hcp.preflight.auto_cost): the host model of CPU
ranks sharing one host's cores, and a fast read-only view of a resolved config. Pure: no
process group."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hcp.config.errors import ConfigError
from hcp.dcp.hardware import read_profile


@dataclass(frozen=True)
class Host:
    """CPU ranks sharing one host's cores (a profile's `host:` entry, e.g. benchmarks/
    cpu_profile.yaml; accelerator profiles have none): the step is the larger of the critical
    path (a rank runs on at most one core: divided by min(1, cores)) and the CPU seconds of all
    ranks over the cores. `cores`: cores the ranks share (a loaded host: the share they get);
    `layer_s`: CPU seconds of one layer's forward + backward call on one rank beyond its FLOPs
    (Python and dispatch; a third of it forward), the LLM's, the encoder's and the projector's
    (one layer) alike; `cp_layer_s`: CPU seconds more per LLM layer call under CP (c > 1: its
    collectives' calls; the profile's `cp_latency` prices each ring step); `module_step_s`: CPU
    seconds per step of each module a rank holds (its gradient sync calls, optimizer, norm)."""

    cores: float
    layer_s: float
    cp_layer_s: float
    module_step_s: float


def host_model(profile) -> Host | None:
    """The `host:` entry of the profile file `profile` (None for `h100` or without one).
    Raises ConfigError naming `packing_profile` for a malformed entry."""
    if str(profile) == "h100":
        return None
    entry = read_profile(profile).get("host")
    if entry is None:
        return None
    try:
        host = Host(**entry)
        if not (host.cores > 0 and min(host.layer_s, host.cp_layer_s, host.module_step_s) >= 0):
            raise ValueError("cores > 0 and the seconds >= 0")
    except (TypeError, ValueError) as e:
        raise ConfigError("packing_profile", str(profile), f"its host: entry {entry} is invalid ({e})",
                          "give host: {cores: N, layer_s: S, cp_layer_s: S, module_step_s: S}") from None
    return host


def layer_calls(host: Host | None, layers, cp: bool = False) -> tuple:
    """(forward, backward) CPU seconds of calling `layers` layers (a count or an array of them)
    once on `host` (0 without one); `cp`: LLM layers under CP (`Host.cp_layer_s` more each)."""
    per = (host.layer_s + (host.cp_layer_s if cp else 0.0)) if host else 0.0
    each = per * np.asarray(layers, dtype=np.float64)
    return each / 3, 2 * each / 3


class Plain(dict):
    """A read-only attribute view of a resolved config (`plain`): the memory and cost models
    read the config for every candidate, where OmegaConf's access costs would dominate."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def plain(node):
    """`node` (a resolved container: dicts, lists, scalars) with every dict a `Plain`."""
    if isinstance(node, dict):
        return Plain({k: plain(v) for k, v in node.items()})
    return [plain(v) for v in node] if isinstance(node, list) else node
