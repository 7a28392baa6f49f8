"""What `llm.attention_backend=te` needs from the installed Transformer Engine, checked by
validation (before any rank starts, without importing TE: its import fails without CUDA) and
again where hcp builds TE's attention (`hcp.model.te_cp`).

- Precision: TE's fused and flash kernels take fp16/bf16 only; with fp32 TE falls back to its
  unfused attention (scores materialised, and no context parallelism at all), so
  `precision=fp32` with `te` is refused.
- CP over THD with `cp_comm_type="all_gather"` (hcp's default `cp_comm=allgather`): TE <= 2.17
  asserts it out (`AttnFuncWithCPAndKVAllGather.forward`: `assert qkv_format != "thd"`, in
  transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py); TE 2.18 runs
  it, through FusedAttention or FlashAttention 3 (hcp passes `pad_between_seqs=True`, which
  disables FlashAttention 2 for THD in TE's backend selection). Below 2.18 the run is refused
  with the fix: `cp_comm=p2p` (TE's ring, supported for THD since 1.x) or a newer TE.
"""
from __future__ import annotations

from importlib import metadata

from hcp.config.errors import ConfigError

TE_THD_ALLGATHER = (2, 18)
"""The first Transformer Engine release whose all-gather CP takes `qkv_format="thd"`."""


def te_version() -> tuple[int, ...] | None:
    """The installed Transformer Engine's release as ints, e.g. (2, 17, 1) (its own
    `__version__` is this distribution's metadata); None when it is not installed. A
    pre-release of 2.18 (`2.18.0.dev0`) counts as 2.18: the release tuple ignores the tag."""
    from packaging.version import InvalidVersion, Version

    try:
        raw = metadata.version("transformer_engine")
    except metadata.PackageNotFoundError:
        return None
    try:
        return Version(raw).release
    except InvalidVersion:
        return None


def check_te(backend: str, precision: str, cp: int, cp_comm: str,
             version: tuple[int, ...] | None = None) -> None:
    """Refuse what TE cannot run (module docstring): `precision=fp32` with `te`, and CP (`cp`:
    the largest CP group of the run) that `check_te_cp` refuses. Raises ConfigError naming the
    field, value and fix."""
    if backend != "te":
        return
    if precision == "fp32":
        raise ConfigError("precision", precision, "llm.attention_backend=te runs fp16/bf16 kernels "
                          "only (fp32 falls back to TE's unfused attention, without CP)",
                          "set precision=bf16, or llm.attention_backend=torch")
    if cp > 1:
        check_te_cp(cp_comm, version)


def check_te_cp(cp_comm: str, version: tuple[int, ...] | None = None) -> None:
    """TE's THD context parallelism with `cp_comm` (hcp's name) on TE `version` (the installed
    one by default; an unknown version passes, TE's own assertion then speaks): ConfigError for
    `allgather` below `TE_THD_ALLGATHER`."""
    if cp_comm != "allgather":
        return
    version = te_version() if version is None else version
    if version is not None and tuple(version[:2]) < TE_THD_ALLGATHER:
        have = ".".join(map(str, version))
        need = ".".join(map(str, TE_THD_ALLGATHER))
        raise ConfigError("llm.layout.cp_comm", cp_comm, f"Transformer Engine {have} runs THD "
                          f"context parallelism with all-gather only from {need} (older releases "
                          "assert qkv_format != 'thd' for cp_comm_type='all_gather')",
                          f"set llm.layout.cp_comm=p2p, or install transformer_engine>={need}")
