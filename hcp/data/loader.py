"""Deterministic global batches and the DP lane's share of them.

The sample order is a function of (seed, epoch) only, and step k of a run reads global batch k
of that stream, so the data-loader position is just the number of consumed global batches:
resuming at step k continues with exactly the samples an uninterrupted run would have seen.
"""
from __future__ import annotations

import numpy as np


class GlobalBatchSampler:
    """Yields global batches of sample indices, `global_batch_size` each (the last partial
    batch of an epoch is dropped), epoch after epoch, reshuffled per epoch from `seed`.

    Raises:
        ValueError: the data set is smaller than one global batch.
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, shuffle: bool = True):
        if num_samples < global_batch_size:
            raise ValueError(f"trainer.global_batch_size={global_batch_size} exceeds the data set "
                             f"({num_samples} samples): lower it or add data")
        self.num_samples, self.gbs, self.seed, self.shuffle = (num_samples, global_batch_size, seed,
                                                               shuffle)
        self.batches_per_epoch = num_samples // global_batch_size
        self.position = 0
        """Global batches consumed so far (the resumable state)."""

    def batch(self, k: int) -> list[int]:
        """Indices of global batch `k` (0-based, across epochs)."""
        epoch, j = divmod(k, self.batches_per_epoch)
        order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
                 if self.shuffle else np.arange(self.num_samples))
        return order[j * self.gbs:(j + 1) * self.gbs].tolist()

    def next(self) -> list[int]:
        out = self.batch(self.position)
        self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def lane_slice(global_batch: list[int], dp: int, lane: int) -> list[int]:
    """DP lane `lane` of `dp` holds a contiguous block of the global batch (docs/design.md: lane).

    Raises:
        ValueError: the global batch is not divisible by `dp`.
    """
    if len(global_batch) % dp:
        raise ValueError(f"trainer.global_batch_size={len(global_batch)} is not divisible by "
                         f"dp={dp}")
    n = len(global_batch) // dp
    return global_batch[lane * n:(lane + 1) * n]
