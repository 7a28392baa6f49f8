"""Dynamic-CP plans: plain dataclasses, their validity rules and input checks.

A plan cuts one global batch of sequences (lengths in tokens) into *rounds* for one CP pool of
`pool = dp * cp` ranks of a pipeline stage (docs/design.md section 3). A round is the pool's CP
grouping between two synchronisations: its groups tile `[0, pool)` with aligned power-of-two
blocks (`rank_offset` a multiple of `cp_size`); a group with no sequences marks idle ranks. A
*micro-batch* is one forward and backward of a group, its sequences packed THD-style and
CP-sharded over the group's `cp_size` ranks, bounded by the cap. Group `g` runs its sequences
`g.seq_indices` (indices into the batch) as `g.micro_batches`: one micro-batch unless
`g.micro_batch_sizes` splits them into several, run one after another inside the round.
- Under PP every micro-batch is a pipeline unit and under `dp_shard` every micro-batch
  synchronises the pool (FSDP's all-gathers), so there each group runs exactly one
  micro-batch per round (a round *is* a micro-batch of the pool; 1F1B runs over rounds).
- At pp = 1 without `dp_shard` a group may run several micro-batches in a round (gradient
  accumulation; Megatron-LM's hybrid CP runs sequences this way between its barriers).
Memory: each rank of a group of c > 1 ranks holds `2 * ceil(L / 2c)` tokens of a document of
length L (head-tail sharding pads it to a multiple of 2c, docs/design.md section 3;
hcp/parallel/cp_sharding.py), at c = 1 its L tokens; the sum over the documents of each
micro-batch must stay within `max_tokens_per_rank` (`rank_tokens`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from hcp.config.capacity import max_length
from hcp.config.errors import ConfigError

ON_OVERLONG = ("error", "truncate", "skip")


@dataclass
class Group:
    """Sequences run on one aligned block `[rank_offset, rank_offset + cp_size)` of the pool
    in one round: as one micro-batch, or as `micro_batch_sizes` consecutive ones (counts of
    sequences, in `seq_indices` order)."""

    seq_indices: list[int]
    cp_size: int
    rank_offset: int
    micro_batch_sizes: list[int] | None = None

    @property
    def micro_batches(self) -> list[list[int]]:
        """The group's micro-batches in execution order, each a list of sequence indices."""
        if self.micro_batch_sizes is None:
            return [list(self.seq_indices)] if self.seq_indices else []
        out, k = [], 0
        for n in self.micro_batch_sizes:
            out.append(list(self.seq_indices[k:k + n]))
            k += n
        return out


@dataclass
class Round:
    """One round: groups whose blocks tile the pool, between two synchronisations."""

    groups: list[Group]


@dataclass
class Packing:
    """A global batch cut into rounds, in execution order."""

    rounds: list[Round] = field(default_factory=list)

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches of the busiest group sequence: the most any rank runs."""
        return sum(max((len(g.micro_batches) for g in r.groups), default=0) for r in self.rounds)

    def group_of(self, rank: int, round_index: int) -> Group:
        """The group (offset, size, sequences) that pool rank `rank` runs in round j."""
        for g in self.rounds[round_index].groups:
            if g.rank_offset <= rank < g.rank_offset + g.cp_size:
                return g
        raise ValueError(f"rank {rank} is not covered in round {round_index}")

    def cp_histogram(self) -> dict[int, int]:
        """Number of sequences per CP size, `{cp_size: count}` (sorted by size)."""
        hist: dict[int, int] = {}
        for r in self.rounds:
            for g in r.groups:
                if g.seq_indices:
                    hist[g.cp_size] = hist.get(g.cp_size, 0) + len(g.seq_indices)
        return dict(sorted(hist.items()))


def cp_sizes(pool: int) -> np.ndarray:
    """Powers of two 1, 2, ..., pool: the CP sizes of a dynamic-CP pool of `pool` ranks."""
    return 1 << np.arange(int(pool).bit_length())


def rank_tokens(lengths, cp_size) -> np.ndarray:
    """Tokens one rank of a CP group of `cp_size` ranks holds for documents of these lengths
    (broadcast, int64): `2 * ceil(L / 2c)` with head-tail padding (c > 1), `L` at c = 1 (the
    vectorised `hcp.config.capacity.tokens_per_rank`)."""
    lens = np.asarray(lengths, dtype=np.int64)
    c = np.asarray(cp_size, dtype=np.int64)
    return np.where(c == 1, lens, 2 * (-(-lens // (2 * c))))


def rank_tokens_of(length: int, cp_size: int) -> int:
    """`rank_tokens` of one document as a Python int (tokens): the scalar form for the solver's
    inner loops, where a numpy call per sequence costs more than the packing itself."""
    return length if cp_size == 1 else 2 * (-(-length // (2 * cp_size)))


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
    sequence longer than `max_length(pool, max_tokens_per_rank)` (head-tail padding counted)
    cannot fit even on the whole pool:
    `error` raises naming its index and length, `truncate` cuts it to the limit, `skip` drops it.
    """
    pool, max_tokens_per_rank = check_pool(pool, max_tokens_per_rank)
    if on_overlong not in ON_OVERLONG:
        raise ConfigError("on_overlong", on_overlong, "unknown policy", f"use one of {ON_OVERLONG}")
    arr = as_lengths(lengths)
    limit = max_length(pool, max_tokens_per_rank)
    kept = np.arange(arr.size)
    over = arr > limit
    if over.any():
        i = int(np.argmax(over))
        if on_overlong == "error":
            raise ValueError(
                f"sequence {i} has {int(arr[i])} tokens, more than the pool can hold: {limit} = "
                f"the longest L with 2 * ceil(L / (2 * cp_pool)) <= max_tokens_per_rank at "
                f"cp_pool={pool}, max_tokens_per_rank={max_tokens_per_rank}. "
                f"Fix: on_overlong=truncate (cut to "
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


def tile(groups: list[tuple[list[int], int]], pool: int) -> list[Group]:
    """Groups `(sequence indices, CP size)` whose sizes sum to <= pool as aligned blocks
    (largest first, consecutive: power-of-two sizes in decreasing order stay aligned), idle
    ranks filled (`fill_idle`)."""
    out, off = [], 0
    for s, c in sorted(groups, key=lambda g: -g[1]):
        out.append(Group(sorted(s), c, off))
        off += c
    return fill_idle(out, pool)


def validate_plan(plan: Packing, lengths: Sequence[int], pool: int, max_tokens_per_rank: int,
                  several_per_round: bool = False) -> None:
    """Raise ValueError unless the plan places every sequence (an integer index into `lengths`,
    valid as for `as_lengths`) exactly once, tiles the pool with aligned power-of-two blocks in
    every round, has no empty round, keeps every rank of every micro-batch within
    `max_tokens_per_rank` tokens, head-tail padding counted (`rank_tokens`), and, unless
    `several_per_round` (pp = 1 without dp_shard), runs one micro-batch per group and round."""
    pool, max_tokens_per_rank = check_pool(pool, max_tokens_per_rank)
    arr = as_lengths(lengths)
    seen = np.zeros(arr.size, dtype=np.int64)
    for j, mb in enumerate(plan.rounds):
        cover = np.zeros(pool, dtype=np.int64)
        if not any(len(g.seq_indices) for g in mb.groups):
            raise ValueError(f"round {j} holds no sequence")
        for g in mb.groups:
            c, o = g.cp_size, g.rank_offset
            if (not all(isinstance(v, (int, np.integer)) for v in (c, o))
                    or c < 1 or c & (c - 1) or o % c or o < 0 or o + c > pool):
                raise ValueError(f"round {j}: block (offset {o!r}, size {c!r}) is not an "
                                 f"aligned power-of-two block of a pool of {pool}")
            cover[o:o + c] += 1
            bad = [i for i in g.seq_indices if isinstance(i, bool)
                   or not isinstance(i, (int, np.integer)) or not 0 <= i < arr.size]
            if bad:
                raise ValueError(f"round {j}: group at offset {o} has seq_indices entry "
                                 f"{bad[0]!r}; each must be an integer index in [0, {arr.size})")
            idx = np.asarray(g.seq_indices, dtype=np.int64)
            sizes = g.micro_batch_sizes
            if sizes is not None and (sum(sizes) != len(g.seq_indices)
                                      or min(sizes, default=1) < 1):
                raise ValueError(f"round {j}: group at offset {o} has micro_batch_sizes {sizes} "
                                 f"for {len(g.seq_indices)} sequences; they must be >= 1 and sum "
                                 f"to it")
            if len(g.micro_batches) > 1 and not several_per_round:
                raise ValueError(f"round {j}: group at offset {o} runs {len(g.micro_batches)} "
                                 f"micro-batches; with PP or dp_shard each round is one "
                                 f"micro-batch per group")
            for q, mb_seqs in enumerate(g.micro_batches):
                tokens = int(rank_tokens(arr[mb_seqs], c).sum())
                if tokens > max_tokens_per_rank:
                    raise ValueError(f"round {j}: micro-batch {q} of the group at offset {o} "
                                     f"puts {tokens} tokens (head-tail padding to multiples of "
                                     f"2c counted) on each of its {c} ranks, above the cap "
                                     f"{max_tokens_per_rank} per rank")
            np.add.at(seen, idx, 1)
        if (cover != 1).any():
            raise ValueError(f"round {j}: groups do not tile the pool (coverage {cover})")
    if (seen != 1).any():
        i = int(np.argmax(seen != 1))
        raise ValueError(f"sequence {i} is placed {int(seen[i])} times, not once")
