"""Dynamic-CP plans: plain dataclasses, their validity rules and input checks.

A plan cuts one global batch of sequences (lengths in tokens) into micro-batches for one CP pool
of `pool = dp * cp` ranks of a pipeline stage (DESIGN.md section 3). Every micro-batch covers the
whole pool: its groups tile `[0, pool)` with aligned power-of-two blocks (`rank_offset` a multiple
of `cp_size`), so every rank runs the same number of micro-batches and 1F1B applies. A group
with no sequences marks idle ranks (they run an empty micro-batch). Group `g` holds the
sequences `g.seq_indices` (indices into the batch), packed THD-style and CP-sharded over its
`cp_size` ranks; memory: `sum(lengths) <= cp_size * max_tokens_per_rank` (zigzag padding of each
document to a multiple of `2 * cp_size` is the THD packer's concern, at most `2c - 1` tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from hcp.config.errors import ConfigError

ON_OVERLONG = ("error", "truncate", "skip")


@dataclass
class Group:
    """Sequences packed on one aligned block `[rank_offset, rank_offset + cp_size)` of the pool."""

    seq_indices: list[int]
    cp_size: int
    rank_offset: int


@dataclass
class MicroBatch:
    """One micro-batch: groups whose blocks tile the pool."""

    groups: list[Group]


@dataclass
class Plan:
    """A global batch cut into micro-batches, in execution order."""

    micro_batches: list[MicroBatch] = field(default_factory=list)

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)

    def group_of(self, rank: int, micro_batch: int) -> Group:
        """The group (offset, size, sequences) that pool rank `rank` runs in micro-batch j."""
        for g in self.micro_batches[micro_batch].groups:
            if g.rank_offset <= rank < g.rank_offset + g.cp_size:
                return g
        raise ValueError(f"rank {rank} is not covered in micro-batch {micro_batch}")

    def cp_histogram(self, lengths: Sequence[int] | None = None) -> dict[int, int]:
        """Number of sequences per CP size, `{cp_size: count}` (sorted by size)."""
        hist: dict[int, int] = {}
        for mb in self.micro_batches:
            for g in mb.groups:
                if g.seq_indices:
                    hist[g.cp_size] = hist.get(g.cp_size, 0) + len(g.seq_indices)
        return dict(sorted(hist.items()))


def check_pool(pool: int, max_tokens_per_rank: int) -> tuple[int, int]:
    """Return `(pool, max_tokens_per_rank)` as Python ints (their product cannot overflow);
    ConfigError unless both are integers, `pool` (ranks) a power of two >= 1, the cap >= 1 token."""
    for name, v in (("cp_pool", pool), ("max_tokens_per_rank", max_tokens_per_rank)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ConfigError(name, v, f"must be an integer, not {type(v).__name__}",
                              "pass a Python or numpy integer")
    pool, max_tokens_per_rank = int(pool), int(max_tokens_per_rank)
    if pool < 1 or pool & (pool - 1):
        ok = 1 << max(0, pool.bit_length() - 1)
        raise ConfigError("cp_pool", pool, "the dynamic-CP pool (dp * cp) must be a power of two",
                          f"use {ok} or {2 * ok} ranks")
    if max_tokens_per_rank < 1:
        raise ConfigError("max_tokens_per_rank", max_tokens_per_rank,
                          "the per-rank token cap must be at least one token",
                          "set it to the THD capacity of one rank, e.g. 8192")
    return pool, max_tokens_per_rank


def as_lengths(lengths: Sequence[int]) -> np.ndarray:
    """A batch of sequence lengths (tokens) as a 1-D int64 array; ValueError naming the first bad
    entry unless it is non-empty and every length is a whole number in [1, 2**63) (integral
    floats such as 3.0 are accepted, 1.9 is not)."""
    raw = np.asarray(lengths)
    if raw.ndim != 1:
        raise ValueError(f"lengths has shape {raw.shape}: give a flat (1-D) sequence of token "
                         f"counts, one per sequence")
    if raw.size == 0:
        raise ValueError("empty global batch: give at least one sequence length")
    if raw.dtype.kind not in "iuf":
        raise ValueError(f"lengths has dtype {raw.dtype} (first value {raw[:1].tolist()[0]!r}): "
                         f"every length must be an integer token count below 2**63")
    checks = []
    if raw.dtype.kind == "f":
        checks.append((raw != np.floor(raw), "not a whole number of tokens"))
    if raw.dtype.kind != "i":  # NaN fails the first check, +-inf and huge uint64 this one
        checks.append((np.abs(raw) >= 2**63, "beyond int64 (2**63 - 1)"))
    for bad, problem in checks:
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"sequence {i} has length {raw[i].item()!r}: {problem}; lengths "
                             f"must be integer token counts")
    arr = raw.astype(np.int64)
    if (arr < 1).any():
        i = int(np.argmax(arr < 1))
        raise ValueError(f"sequence {i} has length {int(arr[i])}; every length must be >= 1 token")
    return arr


def prepare_lengths(lengths: Sequence[int], pool: int, max_tokens_per_rank: int,
                    on_overlong: str = "error") -> tuple[np.ndarray, np.ndarray]:
    """Validate a batch of lengths (tokens, `as_lengths`) and the pool (`check_pool`); return
    `(lengths, kept)` as int64 arrays.

    `kept` are the original indices of the sequences that go into the plan (all of them unless
    `on_overlong="skip"`); `lengths[k]` is the (possibly truncated) length of `kept[k]`. A
    sequence longer than `pool * max_tokens_per_rank` cannot fit even on the whole pool:
    `error` raises naming its index and length, `truncate` cuts it to the limit, `skip` drops it.
    """
    pool, max_tokens_per_rank = check_pool(pool, max_tokens_per_rank)
    if on_overlong not in ON_OVERLONG:
        raise ConfigError("on_overlong", on_overlong, "unknown policy", f"use one of {ON_OVERLONG}")
    arr = as_lengths(lengths)
    limit = pool * max_tokens_per_rank
    kept = np.arange(arr.size)
    over = arr > limit
    if over.any():
        i = int(np.argmax(over))
        if on_overlong == "error":
            raise ValueError(
                f"sequence {i} has {int(arr[i])} tokens, more than cp_pool * max_tokens_per_rank "
                f"= {pool} * {max_tokens_per_rank} = {limit}. Fix: on_overlong=truncate (cut to "
                f"{limit}) or on_overlong=skip (drop it), or raise max_tokens_per_rank / the pool")
        if on_overlong == "truncate":
            arr = np.minimum(arr, limit)
        else:
            kept = kept[~over]
            arr = arr[~over]
            if arr.size == 0:
                raise ValueError("every sequence is longer than the pool can hold; nothing left")
    return arr, kept


def fill_idle(groups: list[Group], pool: int) -> list[Group]:
    """Return `groups` plus empty groups covering the uncovered ranks with maximal aligned blocks,
    sorted by offset."""
    covered = np.zeros(pool, dtype=bool)
    for g in groups:
        covered[g.rank_offset:g.rank_offset + g.cp_size] = True
    out = list(groups)
    r = 0
    while r < pool:
        if covered[r]:
            r += 1
            continue
        size = r & -r if r else pool  # largest alignment of offset r
        while size > 1 and (r + size > pool or covered[r:r + size].any()):
            size //= 2
        out.append(Group([], size, r))
        r += size
    return sorted(out, key=lambda g: g.rank_offset)


def validate_plan(plan: Plan, lengths: Sequence[int], pool: int, max_tokens_per_rank: int) -> None:
    """Raise ValueError unless the plan places every sequence (an integer index into `lengths`,
    valid as for `as_lengths`) exactly once, tiles the pool with aligned power-of-two blocks in
    every micro-batch, has no empty micro-batch and keeps every rank within
    `max_tokens_per_rank` tokens."""
    pool, max_tokens_per_rank = check_pool(pool, max_tokens_per_rank)
    arr = as_lengths(lengths)
    seen = np.zeros(arr.size, dtype=np.int64)
    for j, mb in enumerate(plan.micro_batches):
        cover = np.zeros(pool, dtype=np.int64)
        if not any(len(g.seq_indices) for g in mb.groups):
            raise ValueError(f"micro-batch {j} holds no sequence")
        for g in mb.groups:
            c, o = g.cp_size, g.rank_offset
            if (not all(isinstance(v, (int, np.integer)) for v in (c, o))
                    or c < 1 or c & (c - 1) or o % c or o < 0 or o + c > pool):
                raise ValueError(f"micro-batch {j}: block (offset {o!r}, size {c!r}) is not an "
                                 f"aligned power-of-two block of a pool of {pool}")
            cover[o:o + c] += 1
            bad = [i for i in g.seq_indices if isinstance(i, bool)
                   or not isinstance(i, (int, np.integer)) or not 0 <= i < arr.size]
            if bad:
                raise ValueError(f"micro-batch {j}: group at offset {o} has seq_indices entry "
                                 f"{bad[0]!r}; each must be an integer index in [0, {arr.size})")
            idx = np.asarray(g.seq_indices, dtype=np.int64)
            tokens = int(arr[idx].sum())
            if tokens > c * max_tokens_per_rank:
                raise ValueError(f"micro-batch {j}: group at offset {o} holds {tokens} tokens on "
                                 f"{c} ranks, above the cap {max_tokens_per_rank} per rank")
            np.add.at(seen, idx, 1)
        if (cover != 1).any():
            raise ValueError(f"micro-batch {j}: groups do not tile the pool (coverage {cover})")
    if (seen != 1).any():
        i = int(np.argmax(seen != 1))
        raise ValueError(f"sequence {i} is placed {int(seen[i])} times, not once")
