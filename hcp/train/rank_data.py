"""What one rank loads for its LLM micro-batches of a step, from the step plan alone: the
text of its micro-batches on the LLM's first stage, the labels on the last (for the loss),
every micro-batch's `StageMeta` (the pipeline's shapes: no metadata broadcast) and, under
dynamic CP, every micro-batch's CP group.
"""
from __future__ import annotations

import numpy as np
import torch

from hcp.comm.p2p import StageMeta
from hcp.data.packing import collate, empty_batch
from hcp.dcp.policy import micro_batch_group
from hcp.parallel.upload import upload


def llm_inputs(mine, indices, dataset, image_token_id: int, stage,
               device) -> tuple[list | None, list]:
    """(its micro-batches as (MicroBatchPlan, batch) pairs on the first stage, else None;
    every micro-batch's `StageMeta`) of this rank's `RankPlan` `mine` over the global batch
    `indices`. Empty micro-batches (plan padding) run where the plan says so (`keep_empty`).
    Raises RuntimeError when the data's packing disagrees with the plan (a stale length index)."""
    batches, metas = [] if stage.first else None, []
    for mb in mine.micro_batches:
        if mb.empty:
            if mine.keep_empty:
                empty = empty_batch(device)
                metas.append(StageMeta.of(empty))
                if batches is not None:
                    batches.append((mb, empty))
            continue
        host_cu = mb.cu_seqlens   # the plan's, on the host
        if stage.first or stage.last:
            samples = [dataset[indices[s]] for s in mb.samples]
        if stage.first:
            ids = getattr(dataset, "stream_ids", None)  # every stream's placeholder positions
            batch = collate(samples, [], image_token_id, ids)
            if not np.array_equal(batch.cu_seqlens.numpy(), host_cu):
                raise RuntimeError(f"step plan and data disagree on a micro-batch: cu_seqlens "
                                   f"{mb.cu_seqlens.tolist()} planned, {batch.cu_seqlens.tolist()} "
                                   f"read")
            batch = batch.to(device)
            batches.append((mb, batch))
            metas.append(StageMeta.of(batch))
            continue
        lengths = tuple(int(n) for n in np.diff(mb.cu_seqlens))  # the plan's, on the host
        host_labels = [t for s in samples for t in s.labels] if stage.last else []
        labels = (upload(host_labels, device, torch.long) if stage.last
                  else torch.full((sum(lengths),), -100, device=device))
        metas.append(StageMeta(upload(host_cu, device), mb.max_seqlen, torch.cat(
            [torch.arange(n, device=device) for n in lengths]), labels, lengths,
            sum(t != -100 for t in host_labels)))
    return batches, metas


def micro_batch_groups(groups, mine, rank: int) -> list:
    """Under dynamic CP, the CP process group of each micro-batch this rank runs (those
    `llm_inputs` gives): the plan's (`MicroBatchPlan.cp_size`, `cp_rank`) pre-built group
    (`hcp.dcp.policy.micro_batch_group`); None at CP size 1 and for an empty micro-batch,
    which runs no CP collective."""
    return [None if mb.empty else micro_batch_group(groups, mb, rank)
            for mb in mine.micro_batches if mine.keep_empty or not mb.empty]
