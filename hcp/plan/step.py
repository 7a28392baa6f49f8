"""The step plan (DESIGN.md 4.1): one pure function decides everything that varies per step.

`plan_step(sizes, layouts, packing, micro_batch_tokens, edges)` maps the global batch's sample
sizes (`hcp.plan.lengths`) to a `StepPlan`, identical on every rank (no randomness, no process
group, no rank asks another what to expect). `StepPlan.rank(r)` is rank r's part: the samples it
encodes per encoder-side module, the LLM micro-batches it runs (packed samples, `cu_seqlens`,
`max_seqlen`, CP group and shard, the offsets of its image rows), the routing of every edge into
the LLM (`hcp.parallel.routing.RankRoute`) and the global counts.

Packing policies map the samples' merged lengths to a `hcp.dcp.plan.Plan` over the LLM's CP pool
(dp * cp ranks of one pipeline stage and TP index, pool position = dp * cp + cp): micro-batches in
execution order, each a set of groups (samples, CP size c, aligned block offset) tiling the pool,
so every rank of the pool runs the same number of micro-batches (a rank whose group is empty runs
an empty micro-batch). `first_fit` is today's static packing: DP lane l takes the contiguous block
l of the global batch and packs it first-fit (each document padded to 2*cp, capacity
micro_batch_tokens * cp), at block offset l*cp with c = cp. `dynamic_cp` (h-dcp) registers its
solver with `register_policy`.

Encoder-side modules (every module but the LLM) use static lanes: lane l of a module with dp
lanes encodes block l of the global batch, on each of its TP replicas; encoder CP is refused
here (`ValueError`), and encoder PP under colocated placement.

Non-colocated placement (`placement=non_colocated`: an edge into the LLM whose source sits on
other ranks than the LLM): a module on an encoder's island (the projector) runs with the
island head's layout (the encoder's TP, DP and PP; the projector on its last stage). The
encoder lane encodes its block as one encoder micro-batch per LLM micro-batch, in the order
the LLM consumes them (`RankPlan.encoder_micro_batches`: encoder micro-batch j holds the lane's
samples that LLM micro-batch j packs, over all LLM lanes, in packing order; empty when it has
none). Each micro-batch then has its own routing table over the edge group
(`hcp.parallel.islands.edge_ranks`: the encoder's last-stage ranks, then the LLM's first-stage
ranks): a source rank's rows are its encoder micro-batch's rows in sample order (TP replicas
split them as under colocation), a destination receives the image rows of its CP shard of that
micro-batch in slot order (`RankPlan.island_routes`, one `RankRoute` per micro-batch, and
`MicroBatchPlan.image_rows == (0, rows)`). Destination TP (`island_route`): `leader` (default;
only TP rank 0 of each destination TP group is in the table and broadcasts inside its group,
`hcp.comm.island`) or `direct` (every TP rank receives, TP rank 0 returns the gradient).

Several encoders or streams (joins, branches: `hcp.config.modules`): every edge into the LLM is
routed from its own stream's sizes (`stream_sizes`, one length index per stream), so each
stream's rows reach the CP rank holding its own placeholder positions; `MicroBatchPlan.
stream_rows` and `Counts.stream_rows` give each stream's rows by source projector, and
`RankPlan.encoder_samples` every encoder's and projector's samples.

Conventions of the routed rows (projector output, one row per image token): `hcp.parallel.routing`.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from hcp.data.packing import first_fit
from hcp.dcp.plan import Group, Plan, Round
from hcp.parallel.grid import Grid
from hcp.parallel.islands import edge_ranks
from hcp.parallel.routing import RankRoute, RowTable, cp_slot
from hcp.plan.lengths import SampleSizes

Policy = Callable[[np.ndarray, object, int], Plan]
"""(merged lengths int64 [B], the LLM's ResolvedLayout, micro_batch_tokens) -> Plan over the
LLM's CP pool whose groups hold positions in the global batch."""

_POLICIES: dict[str, Policy] = {}


def register_policy(name: str, policy: Policy) -> None:
    """Make `policy` the packing policy `packing=name` (replaces an earlier one)."""
    _POLICIES[name] = policy


def first_fit_policy(tokens: np.ndarray, llm, micro_batch_tokens: int) -> Plan:
    """Static lanes, first-fit inside each lane (module docstring); lanes with fewer packs get
    empty groups, so every lane runs the same number of micro-batches.

    Raises ValueError: the batch does not split into llm.dp lanes, or a sample exceeds the cap.
    """
    dp, cp = llm.dp, llm.cp
    if len(tokens) % dp:
        raise ValueError(f"trainer.global_batch_size={len(tokens)} is not divisible by llm dp={dp}")
    n, pad = len(tokens) // dp, 2 * cp
    padded = (-(-tokens // pad) * pad).tolist()
    lanes = [first_fit(padded[lane * n:(lane + 1) * n], micro_batch_tokens * cp) for lane in range(dp)]
    return Plan([Round([Group([lane * n + i for i in packs[j]] if j < len(packs) else [], cp,
                                   lane * cp) for lane, packs in enumerate(lanes)])
                 for j in range(max(map(len, lanes)))])


register_policy("first_fit", first_fit_policy)


@dataclass(frozen=True)
class MicroBatchPlan:
    """One LLM micro-batch as one rank runs it. Sample indices are positions in the global batch.

    An empty micro-batch (`samples == ()`, `cu_seqlens == [0]`) pads a rank's schedule so every
    rank of its collectives runs the same count; it has no tokens, loss or image rows.
    """

    samples: tuple[int, ...]
    """Packed samples (documents) in packing order."""
    cu_seqlens: np.ndarray
    """int32 [N + 1]: merged document boundaries before CP sharding."""
    max_seqlen: int
    """Longest document (merged tokens)."""
    cp_size: int
    """Ranks of the CP group that shares the micro-batch."""
    cp_block: int
    """Index of that group among the aligned blocks of cp_size in the CP pool (DESIGN.md 3)."""
    cp_rank: int
    """This rank's CP shard index inside the group (head-tail chunks r and 2c-1-r)."""
    local_tokens: int
    """Slots of this rank's CP shard: sum over documents of 2 * ceil(L / 2c) at c > 1, of L at
    c = 1 (no sharding, no padding)."""
    image_rows: tuple[int, int]
    """[start, end) of its image rows in the tensor received over the edge into the LLM (only
    on the LLM's first stage; rows in slot order of the local shard). Colocated: one tensor
    for the step; non-colocated: one tensor per micro-batch, so (0, rows) (every TP rank of
    the shard gets it, also under the `leader` route). Several edges into the LLM: the default
    stream's (`projector`, else the first edge's)."""
    stream_rows: dict = field(default_factory=dict)
    """Every edge into the LLM, by source projector: [start, end) of this micro-batch's rows
    in the tensor received over that edge (`image_rows` is one of them)."""

    @property
    def empty(self) -> bool:
        return not self.samples


@dataclass(frozen=True)
class Counts:
    """Global counts of the step (all micro-batches, lanes, CP ranks)."""

    loss_tokens: int
    tokens: int
    """Merged tokens, without CP padding."""
    sum_sq_lengths: float
    """Sum over documents of the squared merged length (attention FLOPs)."""
    image_rows: int = 0
    """Image rows (image tokens) of the whole batch (all streams into the LLM)."""
    stream_rows: dict = field(default_factory=dict)
    """Rows of the whole batch per stream into the LLM, by source projector."""


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a `StepPlan`."""

    rank: int
    encoder_samples: dict[str, tuple[int, ...]]
    """Encoder-side module -> the samples it encodes here, in order (only modules it runs)."""
    micro_batches: list[MicroBatchPlan]
    """Its LLM micro-batches in execution order (empty list when it runs no LLM stage)."""
    routes: dict[tuple[str, str], RankRoute]
    """Edge into the LLM -> this rank's part of its row exchange."""
    counts: Counts
    checksum: int = 0
    """`StepPlan.checksum()` of the whole plan (0: not computed)."""
    encoder_micro_batches: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    """Non-colocated: encoder-side module -> per LLM micro-batch j, the samples this rank's
    lane encodes as its micro-batch j (module docstring); every stage of the lane gets it."""
    island_routes: dict[tuple[str, str], tuple[RankRoute, ...]] = field(default_factory=dict)
    """Non-colocated edge into the LLM -> this rank's `RankRoute` of every micro-batch (edge
    group ranks); only ranks of the edge group have an entry."""


@dataclass
class StepPlan:
    """The plan of one step for every rank (built by `plan_step`). Arrays are numpy int64."""

    sizes: SampleSizes
    layouts: dict
    packing: Plan
    """LLM micro-batches over the CP pool (policy output)."""
    counts: Counts
    encoder_lanes: dict[str, int]
    """Encoder-side module -> its dp (lane l encodes block l of the batch)."""
    tables: dict[tuple[str, str], RowTable]
    """Edge into the LLM -> its rows."""
    group_at: np.ndarray
    """[J, pool] index into `groups` of the group each pool position runs in micro-batch j."""
    groups: list[Group]
    local_tokens: np.ndarray
    """[num groups] slots per rank of each group."""
    image_row_offsets: np.ndarray
    """[pool, J + 1] prefix sums of image rows per pool position over micro-batches (the
    default stream's; `stream_row_offsets` has every stream's)."""
    encoder_grids: dict[str, Grid] = field(default_factory=dict)
    """Encoder-side module -> the grid it runs on (non-colocated: its island head's)."""
    island_tables: dict[tuple[str, str], list[RowTable]] = field(default_factory=dict)
    """Non-colocated edge into the LLM -> one `RowTable` per micro-batch over its edge group."""
    island_ranks: dict[tuple[str, str], tuple[int, ...]] = field(default_factory=dict)
    """Non-colocated edge -> global ranks of its edge group (group rank i is entry i)."""
    consume_order: np.ndarray | None = None
    """[B] each sample's position in the LLM's consumption order (micro-batch, group, packing)."""
    sample_micro_batch: np.ndarray | None = None
    """[B] the LLM micro-batch that consumes each sample."""
    stream_row_offsets: dict = field(default_factory=dict)
    """Source projector of each edge into the LLM -> its [pool, J + 1] prefix sums."""
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_micro_batches(self) -> int:
        return self.group_at.shape[0]

    def checksum(self) -> int:
        """CRC-32 of the packing and every routing table: equal on two ranks iff (up to hash
        collisions) they planned the same step."""
        crc = zlib.crc32(self.group_at.tobytes())
        for g in self.groups:
            crc = zlib.crc32(np.asarray(g.seq_indices + [g.cp_size, g.rank_offset], np.int64).tobytes(), crc)
        for t in [*self.tables.values(), *(t for ts in self.island_tables.values() for t in ts)]:
            for a in (t.src, t.src_row, t.shard, t.dst_row):
                crc = zlib.crc32(a.tobytes(), crc)
        return crc

    def rank(self, rank: int, checksum: bool = False) -> RankPlan:
        """Global rank `rank`'s part (colocated: edge group rank = global rank), with the plan's
        `checksum()` when asked (`trainer.check_plan`)."""
        enc, enc_mbs = {}, {}
        for m, dp in self.encoder_lanes.items():
            grid = self.encoder_grids.get(m) or Grid.of(self.layouts[m])
            if grid.contains(rank):
                n = len(self.sizes) // dp
                lane = grid.coords(rank)["dp"]
                enc[m] = tuple(range(lane * n, (lane + 1) * n))
                if self.island_tables:
                    enc_mbs[m] = self._encoder_micro_batches(enc[m])
        llm = Grid.of(self.layouts["llm"])
        mbs = []
        if llm.contains(rank):
            c = llm.coords(rank)
            pos = c["dp"] * llm.cp + c["cp"]
            zero = np.zeros(len(self.group_at) + 1, np.int64)
            every = {src: off[pos] if c["pp"] == 0 else zero for src, off in self.stream_row_offsets.items()}
            rows = self.image_row_offsets[pos] if c["pp"] == 0 else zero
            if self.island_tables:  # one received tensor per micro-batch
                rows = np.concatenate([[0], np.diff(rows)])
                every = {src: np.concatenate([[0], np.diff(r)]) for src, r in every.items()}
            for j in range(self.num_micro_batches):
                g = self.groups[self.group_at[j, pos]]
                lengths = self.sizes.tokens[np.asarray(g.seq_indices, dtype=np.int64)]
                cu = np.zeros(len(lengths) + 1, dtype=np.int32)
                np.cumsum(lengths, out=cu[1:])
                mbs.append(MicroBatchPlan(tuple(int(s) for s in g.seq_indices), cu,
                                          int(lengths.max()) if len(lengths) else 0, g.cp_size,
                                          g.rank_offset // g.cp_size, pos - g.rank_offset,
                                          int(self.local_tokens[self.group_at[j, pos]]),
                                          (0 if self.island_tables else int(rows[j]), int(rows[j + 1])),
                                          {src: (0 if self.island_tables else int(r[j]), int(r[j + 1]))
                                           for src, r in every.items()}))
        routes = {e: t.route(rank) for e, t in self.tables.items()}
        island = {e: tuple(t.route(self.island_ranks[e].index(rank)) for t in ts)
                  for e, ts in self.island_tables.items() if rank in self.island_ranks[e]}
        return RankPlan(rank, enc, mbs, routes, self.counts, self.checksum() if checksum else 0,
                        enc_mbs, island)

    def _encoder_micro_batches(self, lane_samples) -> tuple[tuple[int, ...], ...]:
        """A lane's samples per LLM micro-batch, in consumption order."""
        lane = np.asarray(lane_samples, dtype=np.int64)
        lane = lane[np.argsort(self.consume_order[lane], kind="stable")]
        mb = self.sample_micro_batch[lane]
        return tuple(tuple(int(s) for s in lane[mb == j]) for j in range(self.num_micro_batches))


def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x) + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def _flatten(plan: Plan, pool: int, batch: int):
    """Groups as flat arrays; checks that every sample appears once and groups tile the pool."""
    if any(g.micro_batch_sizes is not None for r in plan.rounds for g in r.groups):
        raise ValueError("the step plan runs one micro-batch per group and round; a plan whose "
                         "groups run several micro-batches per round is not supported yet")
    groups = [g for r in plan.rounds for g in r.groups]
    mb_of_group = np.repeat(np.arange(len(plan.rounds)), [len(r.groups) for r in plan.rounds])
    size = np.array([g.cp_size for g in groups], dtype=np.int64)
    off = np.array([g.rank_offset for g in groups], dtype=np.int64)
    n_seq = np.array([len(g.seq_indices) for g in groups], dtype=np.int64)
    samples = np.array([s for g in groups for s in g.seq_indices], dtype=np.int64)
    seen = np.bincount(samples, minlength=batch) if len(samples) else np.zeros(batch, np.int64)
    if len(seen) != batch or (seen != 1).any():
        bad = int(np.argmax(seen != 1)) if len(seen) == batch else batch
        raise ValueError(f"packing placed sample {bad} {int(seen[bad]) if bad < batch else 'out of range'} "
                         "times; every sample of the global batch must be in exactly one micro-batch")
    J = len(plan.rounds)
    first = _excl_cumsum(size)
    cover_pos = np.repeat(off, size) + np.arange(first[-1]) - np.repeat(first[:-1], size)
    cover_mb = np.repeat(mb_of_group, size)
    if (off % size).any() or (size & (size - 1)).any() or (cover_pos >= pool).any() or (cover_pos < 0).any():
        raise ValueError(f"packing: a group is not an aligned power-of-two block of the pool of {pool}")
    group_at = np.full((J, pool), -1, dtype=np.int64)
    group_at[cover_mb, cover_pos] = np.repeat(np.arange(len(groups)), size)
    if len(cover_pos) != J * pool or (group_at < 0).any():
        raise ValueError("packing: the groups of a micro-batch do not tile the CP pool")
    return groups, mb_of_group, size, off, n_seq, samples, group_at


def plan_step(sizes: SampleSizes, layouts: dict, packing: str, micro_batch_tokens: int,
              edges=(), island_route: str = "leader", stream_sizes: dict | None = None) -> StepPlan:
    """The step plan of one global batch (module docstring).

    Args:
        sizes: the global batch's sample sizes, in batch order.
        layouts: module -> `hcp.config.layouts.ResolvedLayout` (either placement: an edge into
            the LLM whose source spans other ranks than the LLM is planned non-colocated).
        packing: a registered policy name (`first_fit`, or `dynamic_cp` once registered).
        micro_batch_tokens: THD capacity per rank and micro-batch (tokens).
        edges: module-graph edges `(src, dst)`; those into `llm` are routed.
        island_route: `leader` or `direct`, the destination-TP variant of non-colocated edges.
        stream_sizes: several streams into the LLM (`hcp.config.modules.streams`): source
            projector -> the batch's sizes with that stream's rows as its image arrays
            (`hcp.plan.lengths.stream_indexes`); a stream without an entry uses `sizes`. Text
            tokens and loss tokens always come from `sizes`.

    Raises:
        ValueError: unknown policy or island_route; a policy output that misses or repeats a
            sample or does not tile the pool; a batch that does not split into a module's
            lanes; an encoder-side module with cp > 1, or pp > 1 under colocated placement.
    """
    if packing not in _POLICIES:
        raise ValueError(f"packing={packing!r} has no registered policy: use one of {sorted(_POLICIES)}")
    if island_route not in ("leader", "direct"):
        raise ValueError(f"island_route={island_route!r}: use 'leader' or 'direct'")
    llm = layouts["llm"]
    B, pool = len(sizes), llm.dp * llm.cp
    plan = _POLICIES[packing](sizes.tokens, llm, micro_batch_tokens)
    groups, mb_of_group, size, off, n_seq, samples, group_at = _flatten(plan, pool, B)
    J = group_at.shape[0]
    # per sample: its group, micro-batch, CP size, block offset, local start in its group
    gid = np.repeat(np.arange(len(groups)), n_seq)
    doc_len = sizes.tokens[samples]                                   # per packed document
    slots = np.where(size[gid] == 1, doc_len, 2 * -(-doc_len // (2 * size[gid])))  # c = 1: no padding
    local_tokens = np.bincount(gid, weights=slots, minlength=len(groups)).astype(np.int64)
    starts = _excl_cumsum(slots)[:-1] - np.repeat(_excl_cumsum(local_tokens)[:-1], n_seq)
    doc_start, s_group = np.empty(B, np.int64), np.empty(B, np.int64)
    doc_start[samples], s_group[samples] = starts, gid
    consume = np.empty(B, np.int64)
    consume[samples] = np.arange(B)
    # slots before micro-batch j at each pool position: [pool, J]
    mb_base = np.cumsum(local_tokens[group_at], axis=0) - local_tokens[group_at]

    source = {m: island_head(layouts, edges, m) for m in layouts if m != "llm"}
    encoder_lanes, grids, tables = {}, {}, {}
    for m, head in source.items():
        lay = layouts[head]
        if lay.cp > 1 or (lay.pp > 1 and _same_span(lay, llm)):
            raise ValueError(f"{head}.layout: cp={lay.cp}, pp={lay.pp}: encoder-side CP and PP are "
                             "not supported yet (PP only under placement=non_colocated); use cp=1 and pp=1")
        if head != m and (layouts[m].cp > 1 or layouts[m].pp > 1):
            raise ValueError(f"{m}.layout: cp={layouts[m].cp}, pp={layouts[m].pp}: {m} runs on "
                             f"the last stage of {head}'s island with {head}'s layout; use cp=1, pp=1")
        if B % lay.dp:
            raise ValueError(f"trainer.global_batch_size={B} is not divisible by {m}'s dp={lay.dp}")
        encoder_lanes[m], grids[m] = lay.dp, Grid.of(lay)
    island_tables, island_ranks = {}, {}
    stream_sizes = stream_sizes or {}
    offsets, stream_rows = {}, {}
    for src, dst in edges:
        if dst != "llm":
            continue
        rows = stream_sizes.get(src, sizes)
        if not np.array_equal(rows.tokens, sizes.tokens):
            raise ValueError(f"stream_sizes[{src!r}] has other sample lengths than sizes: both must "
                             "index the same global batch")
        args = (rows, llm, s_group, doc_start, size, off, mb_of_group)
        head = layouts[source[src]]
        if _same_span(head, llm):
            tables[(src, dst)], row_counts = _route_into_llm(layouts[src], mb_base, J, *args)
        else:
            island_tables[(src, dst)], row_counts = _island_route(head, consume, island_route, J, *args)
            island_ranks[(src, dst)] = edge_ranks(Grid.of(head), Grid.of(llm))
        offsets[src] = np.concatenate([np.zeros((pool, 1), np.int64), np.cumsum(row_counts, 1)], 1)
        stream_rows[src] = int(rows.image_rows_each.sum())
    default = "projector" if "projector" in offsets else next(iter(offsets), None)
    image_row_offsets = offsets[default] if default else np.zeros((pool, J + 1), np.int64)
    tok = sizes.tokens
    counts = Counts(int(sizes.loss_tokens.sum()), int(tok.sum()), float((tok.astype(np.float64) ** 2).sum()),
                    sum(stream_rows.values()) if stream_rows else int(sizes.image_rows_each.sum()),
                    stream_rows)
    return StepPlan(sizes, layouts, plan, counts, encoder_lanes, tables, group_at, groups,
                    local_tokens, image_row_offsets, grids, island_tables, island_ranks, consume,
                    mb_of_group[s_group], offsets)


def _same_span(a, b) -> bool:
    return a.rank_offset == b.rank_offset and a.num_ranks == b.num_ranks


def island_head(layouts, edges, module: str) -> str:
    """The module whose layout `module` runs under: itself, or under non-colocated placement
    the encoder heading its island (walking back over edges between modules on the same ranks,
    e.g. projector -> vision). Colocated modules keep their own layouts."""
    if _same_span(layouts[module], layouts["llm"]):
        return module
    head = module
    while True:
        prev = next((a for a, b in edges if b == head and a in layouts and a != "llm"
                     and _same_span(layouts[a], layouts[head])), None)
        if prev is None:
            return head
        head = prev


def _image_rows(sizes, llm, s_group, doc_start, size, off, mb_of_group):
    """Every image row of the batch (rows in sample order): (sample, merged position in it,
    destination pool position, micro-batch, slot in that position's part of the micro-batch)."""
    rows_each = sizes.image_rows_each
    R = int(rows_each.sum())
    img_first = _excl_cumsum(rows_each)
    pos_in_sample = np.repeat(sizes.image_starts - img_first[:-1], rows_each) + np.arange(R)
    sample = np.repeat(np.arange(len(sizes)), sizes.image_rows)
    g = s_group[sample]
    cp_rank, slot = cp_slot(pos_in_sample, sizes.tokens[sample], size[g])
    return sample, off[g] + cp_rank, mb_of_group[g], doc_start[sample] + slot


def _rank_within(key: np.ndarray, part: np.ndarray, parts: int) -> np.ndarray:
    """Each entry's index among the entries of its `part` ordered by `key` (stable)."""
    order = np.lexsort((key, part))
    first = np.searchsorted(part[order], np.arange(parts))
    out = np.empty(len(key), np.int64)
    out[order] = np.arange(len(key)) - first[part[order]]
    return out


def _route_into_llm(src_lay, mb_base, J, sizes, llm, s_group, doc_start, size, off, mb_of_group):
    """The RowTable of a colocated edge from an encoder-side module into the LLM, and the image
    rows per (pool position, micro-batch) [pool, J]."""
    pool = llm.dp * llm.cp
    sample, shard, mb, local = _image_rows(sizes, llm, s_group, doc_start, size, off, mb_of_group)
    R = len(sample)
    row_off = _excl_cumsum(sizes.image_rows)
    # source: lane block; TP replica floor(p * tp / R) sends lane row p (contiguous, balanced)
    n = len(sizes) // src_lay.dp
    lane = sample // n
    lane_first = row_off[np.arange(src_lay.dp) * n]
    lane_rows = row_off[np.arange(1, src_lay.dp + 1) * n] - lane_first
    src_row = np.arange(R) - lane_first[lane]
    tp = src_lay.tp
    replica = src_row * tp // np.maximum(lane_rows[lane], 1)
    src = Grid.of(src_lay).ranks[0, lane, 0, replica]
    # destination: the CP rank whose head-tail chunks hold the row's merged position
    stream = mb_base[mb, shard] + local
    dst_row = _rank_within(stream, shard, pool)
    counts = np.bincount(shard * J + mb, minlength=pool * J).reshape(pool, J)
    shard_ranks = Grid.of(llm).ranks[0].reshape(pool, llm.tp)
    return RowTable(src, src_row, shard, dst_row, shard_ranks, llm.num_ranks), counts


def _island_route(src_lay, consume, variant, J, sizes, llm, s_group, doc_start, size, off, mb_of_group):
    """One RowTable per micro-batch of a non-colocated edge into the LLM (group ranks of
    `edge_ranks`: the source's last-stage ranks lane-major, TP fastest, then the LLM's
    first-stage ranks in pool order, TP fastest), and the image rows per (pool position,
    micro-batch) [pool, J]."""
    pool = llm.dp * llm.cp
    sample, shard, mb, local = _image_rows(sizes, llm, s_group, doc_start, size, off, mb_of_group)
    n, tp = len(sizes) // src_lay.dp, src_lay.tp
    lane = sample // n
    # source row: the lane's micro-batch rows, samples in consumption order (rows in order)
    part = lane * J + mb
    src_row = _rank_within(consume[sample] * (int(sizes.image_rows.max(initial=0)) + 1)
                           + np.arange(len(sample)) - _excl_cumsum(sizes.image_rows)[sample],
                           part, src_lay.dp * J)
    part_rows = np.bincount(part, minlength=src_lay.dp * J)
    replica = src_row * tp // np.maximum(part_rows[part], 1)
    src = lane * tp + replica
    dst_row = _rank_within(local, shard * J + mb, pool * J)
    n_src = src_lay.dp * tp
    reps = 1 if variant == "leader" else llm.tp
    shard_ranks = n_src + np.arange(pool)[:, None] * llm.tp + np.arange(reps)[None, :]
    group = n_src + pool * llm.tp
    tables = []
    for j in range(J):
        k = mb == j
        tables.append(RowTable(src[k], src_row[k], shard[k], dst_row[k], shard_ranks, group))
    counts = np.bincount(shard * J + mb, minlength=pool * J).reshape(pool, J)
    return tables, counts
