"""CP head-tail sharding (docs/design.md section 3): the known value and, for any document lengths,
every token is held exactly once and every rank holds the same share of every document."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hcp.parallel.cp_sharding import cp_shard


def test_known_value_two_documents_cp2():
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert cp_shard(cu, 2, 0).token_index.tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert cp_shard(cu, 2, 1).token_index.tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    assert cp_shard(cu, 2, 1).position_ids.tolist() == [2, 3, 4, 5, 2, 3, 4, 5]
    assert cp_shard(cu, 2, 0).cu_seqlens_padded.tolist() == [0, 8, 16]


def test_short_document_pads_whole_chunks_and_marks_them_invalid():
    shard = cp_shard(torch.tensor([0, 1], dtype=torch.int32), 2, 1)     # 1 token, 4 slots
    assert shard.valid.tolist() == [False, False]
    assert shard.position_ids.tolist() == [1, 2]
    assert cp_shard(torch.tensor([0, 1], dtype=torch.int32), 2, 0).valid.tolist() == [True, False]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.sampled_from([1, 2, 4, 8]))
def test_every_token_held_exactly_once_with_equal_shares(lengths, c):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    shards = [cp_shard(cu, c, r) for r in range(c)]
    held = torch.cat([s.token_index[s.valid] for s in shards]).sort().values
    assert held.tolist() == list(range(int(cu[-1])))
    for s in shards:
        assert torch.equal(s.cu_seqlens, shards[0].cu_seqlens)
        # a held token's position is its offset in its document
        doc = torch.searchsorted(cu[1:].long(), s.token_index[s.valid], right=True)
        assert torch.equal(s.token_index[s.valid] - cu[doc].long(), s.position_ids[s.valid])
    padded = shards[0].cu_seqlens_padded
    assert all(int(x) % (2 * c) == 0 for x in padded[1:] - padded[:-1])
