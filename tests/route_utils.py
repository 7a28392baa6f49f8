"""Hand-built routing inputs for boundary and colocated tests (a small stand-in for the step
plan): a global batch of samples, each one document whose image rows sit at given positions,
static contiguous DP lanes on both sides, and the LLM's first-stage ranks receiving the image
rows of their CP shard of each micro-batch (docs/design.md 4.2, 4.3).

Row keys are global image-row ids: sample s's rows are `offset[s] .. offset[s] + n_s - 1`.
Grid order (docs/design.md section 3): tp fastest, then cp, dp, pp slowest.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from hcp.parallel.cp_sharding import cp_shard


def _route_keys():
    """benchmarks/route_keys.py (routes from per-rank row keys), shared with the benchmarks."""
    if "route_keys" not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "route_keys.py"
        spec = importlib.util.spec_from_file_location("route_keys", path)
        sys.modules["route_keys"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["route_keys"]


build_routes, min_route_rows = _route_keys().build_routes, _route_keys().min_route_rows


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(tp, cp, dp, pp) index of `rank` (grid order tp, cp, dp, pp)."""
        return (rank % self.tp, rank // self.tp % self.cp,
                rank // (self.tp * self.cp) % self.dp, rank // (self.tp * self.cp * self.dp))


def lane(num_samples: int, dp: int, index: int) -> list[int]:
    """The contiguous block of samples of DP lane `index`."""
    assert num_samples % dp == 0, (num_samples, dp)
    per = num_samples // dp
    return list(range(index * per, (index + 1) * per))


@dataclass
class Batch:
    """lengths[s]: tokens of sample s (one document); image_pos[s]: its image positions (sorted)."""

    lengths: list[int]
    image_pos: list[np.ndarray]

    @property
    def rows(self) -> list[int]:
        return [len(p) for p in self.image_pos]

    @property
    def offset(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.rows)]).astype(np.int64)

    def keys(self, samples) -> np.ndarray:
        """Global row ids of `samples`' image rows, in sample order."""
        off = self.offset
        parts = [np.arange(off[s], off[s + 1]) for s in samples]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    def packed(self, samples) -> tuple[torch.Tensor, np.ndarray]:
        """(cu_seqlens int32 [N + 1], key of every packed token, -1 for text) of `samples` packed."""
        cu = torch.tensor([0, *np.cumsum([self.lengths[s] for s in samples])], dtype=torch.int32)
        key = np.full(int(cu[-1]), -1, dtype=np.int64)
        off = self.offset
        for s, start in zip(samples, cu[:-1].tolist()):
            key[start + self.image_pos[s]] = np.arange(off[s], off[s + 1])
        return cu, key


def random_batch(num_samples: int, seed: int, patches=(3, 5), max_images: int = 3) -> Batch:
    """Samples with 0..max_images images of `patches` rows each and 2..9 text tokens, images at
    random positions (so several images, none, and different image sizes all occur)."""
    rng = np.random.default_rng(seed)
    lengths, image_pos = [], []
    for s in range(num_samples):
        n_img = 0 if s % 3 == 1 else int(rng.integers(1, max_images + 1))
        rows = int(sum(rng.choice(patches) for _ in range(n_img)))
        length = rows + int(rng.integers(2, 10))
        lengths.append(length)
        image_pos.append(np.sort(rng.choice(length, rows, replace=False)).astype(np.int64))
    return Batch(lengths, image_pos)


def shard_keys(cu_seqlens: torch.Tensor, token_key: np.ndarray, cp: int, cp_rank: int) -> np.ndarray:
    """Keys of the image rows in CP rank `cp_rank`'s head-tail shard, in local slot order."""
    if cp == 1:
        local = token_key
    else:
        shard = cp_shard(cu_seqlens, cp, cp_rank)
        local = np.where(shard.valid.numpy(), token_key[shard.token_index.numpy()], -1)
    return local[local >= 0]


def micro_batches(samples: list[int], count: int) -> list[list[int]]:
    """`samples` cut into `count` contiguous micro-batches (some may be empty)."""
    return [list(part) for part in np.array_split(np.array(samples, dtype=np.int64), count)]


@dataclass
class RouteInputs:
    src_keys: list[np.ndarray]
    dst_keys: list[np.ndarray]
    grad_owner: list[np.ndarray]
    dst_shard: list[int]
    mb_rows: list[list[tuple[int, int]]]  # per rank: each micro-batch's row range in dst


def image_route(batch: Batch, enc: Layout, llm: Layout, num_micro: int) -> RouteInputs:
    """Keys of the image edge: encoder lanes' rows -> the LLM first stage's CP shards."""
    n = len(batch.lengths)
    src, dst, owner, shard, ranges = [], [], [], [], []
    for r in range(llm.size):
        src.append(batch.keys(lane(n, enc.dp, enc.coords(r)[2])))
        tp_i, cp_i, dp_i, pp_i = llm.coords(r)
        shard.append(r // llm.tp)
        parts, rr = [], []
        if pp_i == 0:
            for mb in micro_batches(lane(n, llm.dp, dp_i), num_micro):
                cu, key = batch.packed(mb)
                k = shard_keys(cu, key, llm.cp, cp_i)
                start = sum(len(p) for p in parts)
                rr.append((start, start + len(k)))
                parts.append(k)
        keys = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        dst.append(keys)
        owner.append(np.full(len(keys), tp_i == 0))
        ranges.append(rr)
    return RouteInputs(src, dst, owner, shard, ranges)


def island_micro_batches(lane_samples: Sequence[int],
                         consumed: Sequence[Sequence[int]]) -> list[list[int]]:
    """An encoder lane's micro-batches in the order the LLM consumes them (docs/design.md 4.4).

    lane_samples: the samples this encoder lane encodes (any order); consumed[i]: the samples
    the LLM consumes in micro-batch i (over all its lanes). Returns, per micro-batch i, the lane's
    samples in consumed[i], in consumed[i]'s order (empty when it has none: the lane still
    takes part in micro-batch i's schedule steps, with 0 rows).

    Raises:
        ValueError: a sample of the lane is consumed twice or never (the plan and the lane
            disagree).
    """
    mine = set(int(s) for s in lane_samples)
    out = [[int(s) for s in mb if int(s) in mine] for mb in consumed]
    seen = [s for mb in out for s in mb]
    if len(seen) != len(set(seen)) or set(seen) != mine:
        missing = sorted(mine - set(seen))
        raise ValueError(f"island_micro_batches: the lane's samples must each be consumed exactly "
                         f"once; never consumed: {missing[:8]}, consumed {len(seen)} times in "
                         f"all for {len(mine)} samples")
    return out
