"""What one document costs a CP rank, the one source of truth for the length rules.

Head-tail CP sharding (docs/design.md 3; hcp/parallel/cp_sharding.py) pads a document of L tokens
to a multiple of 2c on a group of c > 1 ranks, so each rank holds `2 * ceil(L / 2c)` slots;
at c = 1 the document runs whole, unpadded (L slots). Config validation
(`hcp.config.validate.check_trainer`: `data.max_seq_len` against `trainer.micro_batch_tokens`
under static and dynamic CP) and the dynamic-CP planner (`hcp.dcp.packing`: `max_length`,
`rank_tokens` is its vectorised form) both use these two functions.
"""
from __future__ import annotations


def tokens_per_rank(length: int, cp: int) -> int:
    """Slots (tokens) each rank of a CP group of `cp` ranks holds for one document of `length`
    tokens: `2 * ceil(length / 2cp)` at cp > 1 (head-tail padding), `length` at cp = 1. It is
    also the smallest per-rank capacity (`trainer.micro_batch_tokens`) that fits the document."""
    length, cp = int(length), int(cp)
    return length if cp == 1 else 2 * -(-length // (2 * cp))


def max_length(cp: int, max_tokens_per_rank: int) -> int:
    """The longest document a CP group (or dynamic-CP pool) of `cp` ranks holds at
    `max_tokens_per_rank` slots per rank: the largest L with `tokens_per_rank(L, cp) <=
    max_tokens_per_rank`, i.e. `2 * cp * floor(m / 2)` at cp > 1 (m = the cap; `cp * m` for
    an even m) and m at cp = 1."""
    cp, m = int(cp), int(max_tokens_per_rank)
    return m if cp == 1 else 2 * cp * (m // 2)
