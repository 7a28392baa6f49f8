"""Rank classes of a rehearsal (`rehearse.by_class=true`): which ranks' traces follow from
another rank's, computed from the step plan alone, and the renaming that derives them.

A rank's plan slice (`slice_of`) is what `StepPlan.rank` gives it, written as shapes and
global ranks: each sample as its sizes (tokens, loss tokens, image rows of each image), each
routing table's splits as {global rank: rows}, the micro-batches' document lengths, CP sizes and
positions, encoder inputs, the action list. Ranks r and t are of one class when they run the
same modules at the same pipeline stages and a rank permutation `pi` with `pi(r) = t` exists
that (1) swaps coordinates along the grid axes where r and t differ (tp, cp, dp of the grid both
run in; pp never: a stage is a role), (2) maps every process group of the world onto a process
group (`is_automorphism`) and (3) maps r's plan slice of every rehearsed step onto t's
(`rename_slice`). `derive` then writes t's trace as r's with every group and peer renamed by `pi`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from hcp.parallel.grid import Grid

SWAPPED = ("tp", "cp", "dp")
"""Grid axes a class may differ on (AXES but pp: a stage is part of a rank's role)."""


@dataclass(frozen=True)
class RankClass:
    """One class: its representative (the lowest rank, rehearsed) and the ranks derived from it."""

    rep: int
    members: tuple[int, ...]


def _images(sizes, k: int) -> tuple[int, ...]:
    """Image rows of each image of sample `k`: what an encoder lane's work is of it."""
    off = sizes.image_offsets
    return tuple(int(x) for x in sizes.image_rows_each[off[k]:off[k + 1]])


def _sample(sizes, k: int) -> tuple:
    """Sample `k` as the LLM runs it: tokens, loss tokens (the LM head scores those rows) and
    images."""
    return int(sizes.tokens[k]), int(sizes.loss_tokens[k]), _images(sizes, k)


def _by_rank(splits, ranks) -> dict[int, int]:
    return {int(ranks[j]): int(s) for j, s in enumerate(splits) if s}


def _route(route, ranks) -> tuple:
    """A `RankRoute` as shapes: splits by global rank (`ranks[j]`: group rank j's; colocated:
    j itself), row counts. Its row orders (`send_index`, ...) shape no op and are left out."""
    return (_by_rank(route.send_splits, ranks), _by_rank(route.recv_splits, ranks),
            _by_rank(route.grad_send_splits, ranks), _by_rank(route.grad_recv_splits, ranks),
            route.dst_rows, len(route.send_index), len(route.recv_index))


def slice_of(step, rank: int) -> dict:
    """Rank `rank`'s part of the `StepPlan` `step` as shapes and global ranks (module docstring)."""
    mine, sizes = step.rank(rank), step.sizes
    image = lambda m, k: _images(step.module_sizes.get(m, sizes), k)  # noqa: E731
    mbs = tuple((tuple(_sample(sizes, k) for k in mb.samples), tuple(int(x) for x in mb.cu_seqlens),
                 mb.max_seqlen, mb.cp_size, mb.cp_block, mb.cp_rank, mb.local_tokens,
                 tuple(mb.image_rows), tuple(sorted(mb.stream_rows.items())))
                 for mb in mine.micro_batches)
    return {"micro_batches": mbs,
            "encoder": {m: tuple(image(m, k) for k in ks)
                        for m, ks in mine.encoder_samples.items()},
            "encoder_micro_batches": {m: tuple(tuple(image(m, k) for k in mb) for mb in mbs_)
                                      for m, mbs_ in mine.encoder_micro_batches.items()},
            "routes": {e: _route(r, range(len(r.send_splits))) for e, r in mine.routes.items()},
            "island_routes": {e: tuple(_route(r, step.island_ranks[e]) for r in rs)
                              for e, rs in mine.island_routes.items()},
            "encoder_inputs": dict(mine.encoder_inputs), "encoder_rows": dict(mine.encoder_rows),
            "counts": mine.counts, "keep_empty": mine.keep_empty, "overlap": mine.overlap_grad_sync,
            "actions": tuple(mine.actions)}


def _rename_route(route: tuple, pi) -> tuple:
    return tuple({pi[k]: v for k, v in part.items()} for part in route[:4]) + route[4:]


def rename_slice(s: dict, pi) -> dict:
    """Plan slice `s` with every global rank r written as `pi[r]`."""
    out = dict(s)
    out["routes"] = {e: _rename_route(r, pi) for e, r in s["routes"].items()}
    out["island_routes"] = {e: tuple(_rename_route(r, pi) for r in rs)
                            for e, rs in s["island_routes"].items()}
    return out


def role_key(layouts: dict, rank: int) -> tuple:
    """(module, pipeline stage) of every module `rank` runs: ranks of one class share it."""
    return tuple((m, Grid.of(lay).coords(rank)["pp"]) for m, lay in layouts.items()
                 if Grid.of(lay).contains(rank))


def permutation(layouts: dict, world: int, rep: int, t: int) -> tuple[int, ...] | None:
    """The rank permutation `pi` with `pi[rep] = t`: on the grid of the last module (graph order)
    both run, the coordinates of `rep` and `t` swapped along each axis where they differ; every
    other rank fixed. None when they share no grid or differ in pipeline stage."""
    grid = next((Grid.of(lay) for lay in reversed(layouts.values())
                 if Grid.of(lay).contains(rep) and Grid.of(lay).contains(t)), None)
    if grid is None:
        return None
    a, b = grid.coords(rep), grid.coords(t)
    if a["pp"] != b["pp"]:
        return None
    pi = list(range(world))
    for r in grid.ranks.reshape(-1).tolist():
        c = grid.coords(r)
        for axis in SWAPPED:
            if a[axis] != b[axis] and c[axis] in (a[axis], b[axis]):
                c[axis] = b[axis] if c[axis] == a[axis] else a[axis]
        pi[r] = grid.rank_at(**c)
    return tuple(pi)


def is_automorphism(pi, groups: set[frozenset]) -> bool:
    """Whether `pi` maps every group of `groups` (rank sets) onto one of them."""
    return all(frozenset(pi[r] for r in g) in groups for g in groups)


def rank_classes(layouts: dict, world: int, slices: dict[int, list],
                 groups: set[frozenset]) -> list[RankClass]:
    """The classes of the world's ranks (module docstring); `slices`: rank -> its `slice_of`
    each rehearsed step, computed on that rank (None: its planner raised, so it is its own class);
    `groups`: the rank sets of every group the world creates. Ranks in order: each joins the
    first class whose representative maps onto it."""
    reps: dict[tuple, list[int]] = {}
    members: dict[int, list[int]] = {}
    for t in range(world):
        candidates = reps.setdefault(role_key(layouts, t), [])
        for rep in candidates if slices[t] is not None else ():
            pi = permutation(layouts, world, rep, t)
            if (pi is not None and slices[rep] is not None and is_automorphism(pi, groups)
                    and [rename_slice(s, pi) for s in slices[rep]] == slices[t]):
                members[rep].append(t)
                break
        else:
            candidates.append(t)
            members[t] = [t]
    return [RankClass(rep, tuple(ms)) for rep, ms in sorted(members.items())]


def derive(result, t: int, pi, names: dict[frozenset, str]):
    """Rank `t`'s `RankResult` from its representative's (`result`): every op's group renamed by
    `pi` (its name looked up in `names`, rank set -> group name of every group created, unless
    the group maps onto itself), its peer renamed, an all-to-all's splits reordered to the
    renamed group's member order. Memory, FLOPs and group creations are the representative's.

    Raises:
        ValueError: a renamed group that the world does not create (not a class)."""
    from hcp.preflight.rehearse.record import Op

    ops = []
    for op in result.ops:
        moved = [pi[r] for r in op.group]
        group = tuple(sorted(moved))
        name = op.group_name
        if len(group) > 1 and set(group) != set(op.group):
            if frozenset(group) not in names:
                raise ValueError(f"rank {result.rank}'s group {list(op.group)} renamed for rank "
                                 f"{t} is {list(group)}, which no rank creates")
            name = names[frozenset(group)]
        splits = op.splits
        if splits is not None:
            at = [group.index(r) for r in moved]
            splits = tuple(tuple(part[at.index(i)] for i in range(len(group))) for part in splits)
        ops.append(Op(op.kind, op.op, group, name, op.shapes, op.dtype, op.step,
                      None if op.peer is None else pi[op.peer], op.tag, op.batch, splits,
                      op.reduce_op))
    out = copy.copy(result)
    out.rank, out.ops, out.derived_from = t, ops, result.rank
    return out

