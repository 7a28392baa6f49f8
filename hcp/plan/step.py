"""The step plan (docs/design.md 4.1): one pure function decides everything that varies per step.

`plan_step(sizes, layouts, packing, micro_batch_tokens, edges)` maps the global batch's sample
sizes (`hcp.plan.lengths`) to a `StepPlan`, identical on every rank (no randomness, no process
group). `StepPlan.rank(r)` is rank r's part (`hcp.plan.rank_plan.RankPlan`): the samples it
encodes per encoder-side module, its LLM micro-batches (packed samples, `cu_seqlens`, CP group
and shard, image-row offsets), the routing of every edge into the LLM
(`hcp.parallel.routing.RankRoute`), the global counts and its action list (`hcp.plan.actions`).

The packing policy (`hcp.plan.policies`: `first_fit`, or `dynamic_cp` once registered) packs
the LLM's micro-batches; each edge into the LLM is routed by `hcp.plan.routes` (colocated: one
table per step) or `hcp.plan.island_routes` (non-colocated: one per micro-batch). Encoder-side
modules' DP lanes: colocated, lane l encodes block l of the batch (the route's lanes map in
blocks); on an island, the lanes share the inputs evenly (`island_routes.balanced_lanes`).
Encoder CP: `hcp.parallel.encoder_cp`; encoder PP under colocated placement raises ValueError.
Several streams are each routed from their own sizes (`stream_sizes`). Row conventions:
`hcp.parallel.routing`."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from hcp.dcp.packing import Group, Packing
from hcp.dcp.policy import several_per_round
from hcp.parallel.grid import Grid
from hcp.parallel.islands import edge_ranks
from hcp.parallel.routing import RowTable
from hcp.plan.actions import rank_actions
from hcp.plan.island_routes import balanced_lanes, island_head, route_from_island, same_span
from hcp.plan.lengths import SampleSizes
from hcp.plan.policies import Policy, first_fit_policy, policy, register_policy
from hcp.plan.rank_plan import Counts, MicroBatchPlan, RankPlan
from hcp.plan.routes import cp_sample_rows, excl_cumsum, route_into_llm

__all__ = ["Counts", "MicroBatchPlan", "Policy", "RankPlan", "StepPlan", "first_fit_policy",
           "island_head", "plan_step", "register_policy"]


@dataclass
class StepPlan:
    """The plan of one step for every rank (built by `plan_step`). Arrays are numpy int64."""

    sizes: SampleSizes
    layouts: dict
    packing: Packing
    """LLM micro-batches over the CP pool (policy output)."""
    counts: Counts
    encoder_lanes: dict[str, int]
    """Encoder-side module -> its dp (its lanes' samples: `lane_of`)."""
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
    module_sizes: dict = field(default_factory=dict)
    """Encoder-side module -> the sizes of its stream (a projector into the LLM: its own; an
    encoder: its first stream's, whose `images` are its inputs per sample)."""
    keep_empty: bool = False
    """Every LLM rank runs its empty micro-batches (plan padding) because they pad collectives
    that span lanes: under FSDP (`llm.layout.dp_shard`: all-gathers over DP x CP), across
    islands (every LLM lane runs every micro-batch of the encoder islands' graph 1F1B), and
    under dynamic CP with PP (every stage rank of the pool keeps the plan's order). Elsewhere
    they are skipped."""
    overlap_grad_sync: bool = True
    """The DP x CP gradient reduction may start inside a rank's last backward. Not under
    dynamic CP when a CP group may run several micro-batches per round
    (`hcp.dcp.policy.several_per_round`): the ranks of the pool then run different counts, and
    a rank's last backward may be a micro-batch of a CP group over the whole pool (the same
    communicator) that other ranks run before more micro-batches; a reduction launched inside
    it would cross that group's CP collectives (gloo fails, NCCL would hang)."""
    edges: tuple = ()
    """The module graph's edges `(src, dst)` (each rank's action list follows them)."""
    lane_of: dict = field(default_factory=dict)
    """Encoder-side module -> [B] the DP lane that encodes each sample (module docstring; a
    module on an encoder's island shares its head's)."""

    @property
    def num_micro_batches(self) -> int:
        return self.group_at.shape[0]

    def checksum(self) -> int:
        """A 63-bit digest (BLAKE2b) of everything the ranks act on: the batch's sizes, the
        packing (groups, their CP blocks, slots per rank), image-row offsets, every routing
        table and the global counts. Equal on two ranks iff (up to a 2**-63 collision) they
        planned the same step; independent of PYTHONHASHSEED and the platform's byte order.
        63 bits so that it and its negation fit an int64 (`hcp.train.plan_check`)."""
        h = hashlib.blake2b(digest_size=8)

        def feed(*arrays):
            for a in arrays:
                a = np.ascontiguousarray(a, dtype="<i8")
                h.update(np.array(a.shape, dtype="<i8").tobytes() + a.tobytes())

        sz = self.sizes
        feed(sz.tokens, sz.loss_tokens, sz.image_offsets, sz.image_starts, sz.image_rows_each,
             self.group_at, self.local_tokens, self.image_row_offsets)
        for g in self.groups:
            feed(list(g.seq_indices), [g.cp_size, g.rank_offset])
        tables = [*self.tables.values(), *(t for ts in self.island_tables.values() for t in ts)]
        for t in tables:
            feed(t.src, t.src_row, t.shard, t.dst_row, t.shard_ranks)
        for ranks in self.island_ranks.values():
            feed(list(ranks))
        feed(*self.lane_of.values())
        c = self.counts
        h.update(repr((c.loss_tokens, c.tokens, float(c.sum_sq_lengths), c.image_rows)).encode())
        return int.from_bytes(h.digest(), "little") & (2**63 - 1)

    def rank(self, rank: int, checksum: bool = False) -> RankPlan:
        """Global rank `rank`'s part (colocated: edge group rank = global rank), with the plan's
        `checksum()` when asked (`trainer.check_plan`, on by default)."""
        enc, enc_mbs, inputs, rows_out = {}, {}, {}, {}
        into = {src for src, _ in self.island_tables}
        for m in self.encoder_lanes:
            grid = self.encoder_grids.get(m) or Grid.of(self.layouts[m])
            if grid.contains(rank):
                at = grid.coords(rank)
                enc[m] = tuple(np.flatnonzero(self.lane_of[m] == at["dp"]).tolist())
                if self.island_tables:
                    enc_mbs[m] = self._encoder_micro_batches(enc[m])
                    sz = self.module_sizes.get(m, self.sizes)
                    per = [np.asarray(mb, dtype=np.int64) for mb in enc_mbs[m]]
                    inputs[m] = tuple(int(sz.images[k].sum()) for k in per)
                    if m in into:  # this CP rank's rows of them (encoder CP)
                        mine = cp_sample_rows(sz, grid.cp, at["cp"])
                        rows_out[m] = tuple(int(mine[k].sum()) for k in per)
        llm = Grid.of(self.layouts["llm"])
        mbs = []
        if llm.contains(rank):
            c = llm.coords(rank)
            pos = c["dp"] * llm.cp + c["cp"]
            zero = np.zeros(len(self.group_at) + 1, np.int64)
            every = {src: off[pos]
                     if c["pp"] == 0 else zero for src, off in self.stream_row_offsets.items()}
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
                                          (0 if self.island_tables else int(rows[j]),
                                           int(rows[j + 1])),
                                          {src: (0 if self.island_tables else int(r[j]),
                                                 int(r[j + 1]))
                                           for src, r in every.items()}))
        routes = {e: t.route(rank) for e, t in self.tables.items()}
        island = {e: tuple(t.route(self.island_ranks[e].index(rank)) for t in ts)
                  for e, ts in self.island_tables.items() if rank in self.island_ranks[e]}
        runs = sum(1 for mb in mbs if self.keep_empty or not mb.empty)
        actions = rank_actions(self, rank, runs)
        return RankPlan(rank, enc, mbs, routes, self.counts, self.checksum() if checksum else 0,
                        enc_mbs, island, inputs, rows_out, self.keep_empty, self.overlap_grad_sync,
                        actions)

    def _encoder_micro_batches(self, lane_samples) -> tuple[tuple[int, ...], ...]:
        """A lane's samples per LLM micro-batch, in consumption order."""
        lane = np.asarray(lane_samples, dtype=np.int64)
        lane = lane[np.argsort(self.consume_order[lane], kind="stable")]
        mb = self.sample_micro_batch[lane]
        return tuple(tuple(int(s) for s in lane[mb == j]) for j in range(self.num_micro_batches))


def _flatten(plan: Packing, pool: int, batch: int):
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
        raise ValueError(f"packing placed sample {bad} "
                         f"{int(seen[bad]) if bad < batch else 'out of range'} times; every sample "
                         f"of the global batch must be in exactly one micro-batch")
    J = len(plan.rounds)
    first = excl_cumsum(size)
    cover_pos = np.repeat(off, size) + np.arange(first[-1]) - np.repeat(first[:-1], size)
    cover_mb = np.repeat(mb_of_group, size)
    if (off
        % size).any() or (size & (size
                                  - 1)).any() or (cover_pos >= pool).any() or (cover_pos < 0).any():
        raise ValueError(f"packing: a group is not an aligned power-of-two block of the pool of "
                         f"{pool}")
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
            lanes; an encoder-side module with pp > 1 under colocated placement.
    """
    if island_route not in ("leader", "direct"):
        raise ValueError(f"island_route={island_route!r}: use 'leader' or 'direct'")
    llm = layouts["llm"]
    B, pool = len(sizes), llm.dp * llm.cp
    plan = policy(packing)(sizes.tokens, llm, micro_batch_tokens)
    groups, mb_of_group, size, off, n_seq, samples, group_at = _flatten(plan, pool, B)
    J = group_at.shape[0]
    # per sample: its group, micro-batch, CP size, block offset, local start in its group
    gid = np.repeat(np.arange(len(groups)), n_seq)
    doc_len = sizes.tokens[samples]                                   # per packed document
    # c = 1: no padding
    slots = np.where(size[gid] == 1, doc_len, 2 * -(-doc_len // (2 * size[gid])))
    local_tokens = np.bincount(gid, weights=slots, minlength=len(groups)).astype(np.int64)
    starts = excl_cumsum(slots)[:-1] - np.repeat(excl_cumsum(local_tokens)[:-1], n_seq)
    doc_start, s_group = np.empty(B, np.int64), np.empty(B, np.int64)
    doc_start[samples], s_group[samples] = starts, gid
    consume = np.empty(B, np.int64)
    consume[samples] = np.arange(B)
    # slots before micro-batch j at each pool position: [pool, J]
    mb_base = np.cumsum(local_tokens[group_at], axis=0) - local_tokens[group_at]

    source = {m: island_head(layouts, edges, m) for m in layouts if m != "llm"}
    into = [src for src, dst in edges if dst == "llm"]
    fed = {m: next((b for a, b in edges if a == m and b in into), None) for m in source}
    stream_sizes = stream_sizes or {}
    module_sizes = {m: stream_sizes.get(m if m in into else fed[m], sizes) for m in source}
    encoder_lanes, grids, tables, lane_of = {}, {}, {}, {}
    for m, head in source.items():
        lay = layouts[head]
        if lay.pp > 1 and same_span(lay, llm):
            raise ValueError(f"{head}.layout: pp={lay.pp}: encoder-side PP runs only under "
                             "placement=non_colocated; use pp=1")
        if head != m and (layouts[m].cp not in (1, lay.cp) or layouts[m].pp > 1):
            raise ValueError(f"{m}.layout: cp={layouts[m].cp}, pp={layouts[m].pp}: {m} runs on "
                             f"the last stage of {head}'s island with {head}'s layout; use cp=1, "
                             f"pp=1")
        if B % lay.dp:
            raise ValueError(f"trainer.global_batch_size={B} is not divisible by {m}'s dp={lay.dp}")
        encoder_lanes[m], grids[m] = lay.dp, Grid.of(lay)
        if head not in lane_of:
            lane_of[head] = (np.arange(B) // (B // lay.dp) if same_span(lay, llm) else
                             balanced_lanes(module_sizes[head].images, mb_of_group[s_group],
                                            consume, lay.dp))
        lane_of[m] = lane_of[head]
    island_tables, island_ranks = {}, {}
    offsets, stream_rows = {}, {}
    for src, dst in edges:
        if dst != "llm":
            continue
        rows = stream_sizes.get(src, sizes)
        if not np.array_equal(rows.tokens, sizes.tokens):
            raise ValueError(f"stream_sizes[{src!r}] has other sample lengths than sizes: both "
                             f"must index the same global batch")
        args = (rows, llm, s_group, doc_start, size, off, mb_of_group)
        head = layouts[source[src]]
        if same_span(head, llm):
            tables[(src, dst)], row_counts = route_into_llm(layouts[src], lane_of[src], mb_base, J,
                                                            *args)
        else:
            island_tables[(src, dst)], row_counts = route_from_island(head, lane_of[src], consume,
                                                                      island_route, J, *args)
            island_ranks[(src, dst)] = edge_ranks(Grid.of(head), Grid.of(llm))
        offsets[src] = np.concatenate([np.zeros((pool, 1), np.int64), np.cumsum(row_counts, 1)], 1)
        stream_rows[src] = int(rows.image_rows_each.sum())
    default = "projector" if "projector" in offsets else next(iter(offsets), None)
    image_row_offsets = offsets[default] if default else np.zeros((pool, J + 1), np.int64)
    tok = sizes.tokens
    counts = Counts(int(sizes.loss_tokens.sum()), int(tok.sum()),
                    float((tok.astype(np.float64) ** 2).sum()),
                    sum(stream_rows.values()) if stream_rows else int(sizes.image_rows_each.sum()),
                    stream_rows)
    dynamic = packing == "dynamic_cp"
    return StepPlan(sizes, layouts, plan, counts, encoder_lanes, tables, group_at, groups,
                    local_tokens, image_row_offsets, grids, island_tables, island_ranks, consume,
                    mb_of_group[s_group], offsets, module_sizes=module_sizes,
                    keep_empty=bool(island_tables or llm.dp_shard or (dynamic and llm.pp > 1)),
                    overlap_grad_sync=not (dynamic and several_per_round(llm)),
                    edges=tuple(tuple(e) for e in edges), lane_of=lane_of)
