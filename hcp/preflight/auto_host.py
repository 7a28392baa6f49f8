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
    seconds per step of each module a rank holds (its gradient sync calls, optimizer, norm);
    `stacked_cores`: cores the ranks get for their long stretches of compute between two
    blocking calls (None: `cores`): a host that balances its cores by load between process
    groups (Linux's autogroup) leaves busy ranks that never block stacked on the cores they ran
    on, and other jobs take the rest, while ranks that wait often are spread again on every
    wake-up; of a stretch of x CPU seconds, x / (x + `spread_s`) of it runs stacked
    (`stacked_seconds`)."""

    cores: float
    layer_s: float
    cp_layer_s: float
    module_step_s: float
    stacked_cores: float | None = None
    spread_s: float = 0.0


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
        if not (host.cores > 0 and (host.stacked_cores is None or host.stacked_cores > 0)
                and min(host.layer_s, host.cp_layer_s, host.module_step_s, host.spread_s) >= 0):
            raise ValueError("cores and stacked_cores > 0 and the seconds >= 0")
    except (TypeError, ValueError) as e:
        raise ConfigError("packing_profile", str(profile),
                          f"its host: entry {entry} is invalid ({e})",
                          "give host: {cores: N, layer_s: S, cp_layer_s: S, module_step_s: S} "
                          "(optional: stacked_cores: N, spread_s: S)") from None
    return host


def layer_calls(host: Host | None, layers, cp: bool = False) -> tuple:
    """(forward, backward) CPU seconds of calling `layers` layers (a count or an array of them)
    once on `host` (0 without one); `cp`: LLM layers under CP (`Host.cp_layer_s` more each)."""
    per = (host.layer_s + (host.cp_layer_s if cp else 0.0)) if host else 0.0
    each = per * np.asarray(layers, dtype=np.float64)
    return each / 3, 2 * each / 3


def stacked_seconds(host: Host | None, stretches, counts=1.0) -> float:
    """CPU seconds of the stretches `stretches` (an array of seconds of compute between two
    blocking calls, each run `counts` times) that `host` runs on its `stacked_cores`:
    sum(counts * x * x / (x + spread_s)); 0 without a host or without `stacked_cores`."""
    if host is None or host.stacked_cores is None:
        return 0.0
    x = np.asarray(stretches, dtype=np.float64)
    part = np.divide(x * x, x + host.spread_s, out=np.zeros_like(x), where=x > 0)
    return float(np.sum(np.asarray(counts, dtype=np.float64) * part))


def host_seconds(host: Host, work: float, stacked: float) -> float:
    """Seconds `host`'s cores take for `work` CPU seconds of all ranks, `stacked` of them in
    long stretches (`stacked_seconds`): the rest over `cores`, those over `stacked_cores`."""
    return (work - stacked) / host.cores + stacked / (host.stacked_cores or host.cores)


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
