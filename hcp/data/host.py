"""What planning needs from the data layer, without torch: the label that carries no loss and
static first-fit packing. The step planner (hcp/plan) and the plan-ahead worker process
(hcp/plan/ahead.py) import this, not the tensor-side modules (`hcp.data.packing`,
`hcp.data.llava`), so the worker never imports torch.
"""
from __future__ import annotations

IGNORE_INDEX = -100
"""Label of a position without loss (prompt, image placeholder, padding)."""


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Static `packing=first_fit`: each sample, in arrival order, goes into the first micro-batch
    with room for it (at most `capacity` tokens each), else opens a new one.

    Returns the sample indices of each micro-batch, in arrival order.

    Raises:
        ValueError: a sample is longer than `capacity` (names its index and the knob to raise).
    """
    packs: list[list[int]] = []
    free: list[int] = []
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"sample {i} has {n} tokens > trainer.micro_batch_tokens={capacity}: "
                             "raise trainer.micro_batch_tokens or lower data.max_seq_len")
        for j, room in enumerate(free):
            if n <= room:
                packs[j].append(i)
                free[j] -= n
                break
        else:
            packs.append([i])
            free.append(capacity - n)
    return packs
