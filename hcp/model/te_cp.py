"""`llm.attention_backend=te` under CP: Transformer Engine's own THD context parallelism
(`DotProductAttention` with `qkv_format="thd"`, `attn_mask_type="padding_causal"` and the
micro-batch's CP group, set per call since dynamic CP gives every micro-batch its own group).

TE shards a THD sequence the way `hcp.parallel.cp_sharding` does (each document padded to a
multiple of 2c, rank r holding chunks r and 2c-1-r), so the local q, k, v go in as they are,
with the WHOLE micro-batch's boundaries: `cu_seqlens` (the real lengths) and
`cu_seqlens_padded` (padded to 2c), and `pad_between_seqs=True`: the padded and real
boundaries differ, and left to infer it TE <= 2.17 compares them with `torch.equal` (a
device-to-host read in every layer). `cp_comm=allgather` needs TE >= 2.18
(`hcp.config.te_rules`, checked by validation and here). Imported lazily
(`transformer_engine.pytorch` needs CUDA); exercised by `scripts/gpu_check.sh`, not by the CPU
tests.
"""
from __future__ import annotations

import importlib
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from hcp.config.te_rules import check_te_cp
from hcp.parallel.cp_sharding import host_cu
from hcp.parallel.upload import upload

TE_COMM = {"allgather": "all_gather", "p2p": "p2p"}
"""hcp's `cp_comm` -> TE's `cp_comm_type`."""


def te_cp_attention(comm: str) -> Callable:
    """`for_micro_batch(cu_seqlens_host, group, device) -> attend(q [T_loc, Hq, D], k [T_loc, Hkv,
    D], v) -> [T_loc, Hq, D]` on TE's THD CP (`cu_seqlens_host`: the whole micro-batch's
    boundaries, int [N + 1] on the host; the device boundaries are built once per micro-batch).

    Raises ImportError (naming the fix) when Transformer Engine is not importable, ConfigError
    when it is too old for `comm` (`hcp.config.te_rules.check_te_cp`).
    """
    check_te_cp(comm)
    try:
        te = importlib.import_module("transformer_engine.pytorch")
    except Exception as err:  # noqa: BLE001 - TE raises OSError/RuntimeError without CUDA libraries
        raise ImportError(f"llm.attention_backend=te with CP needs Transformer Engine, which does "
                          f"not import here ({type(err).__name__}: {err}); install it on a CUDA "
                          f"machine or set llm.attention_backend=torch") from err
    cores: dict = {}
    streams: dict = {}

    def for_micro_batch(cu_seqlens_host, group, device):
        c = dist.get_world_size(group)
        cu = host_cu(cu_seqlens_host)
        padded = np.concatenate([[0], np.cumsum(-(-np.diff(cu) // (2 * c)) * 2 * c)])
        max_len = int(np.diff(padded).max()) if len(padded) > 1 else 0
        dev = lambda x: upload(x, device, torch.int32)  # noqa: E731
        bounds = dict(cu_seqlens_q=dev(cu), cu_seqlens_kv=dev(cu), cu_seqlens_q_padded=dev(padded),
                      cu_seqlens_kv_padded=dev(padded), max_seqlen_q=max_len, max_seqlen_kv=max_len)
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)
        ranks = dist.get_process_group_ranks(group)

        def attend(q, k, v):
            key = (q.shape[1], k.shape[1], q.shape[2])
            if key not in cores:
                cores[key] = te.DotProductAttention(q.shape[1], q.shape[2],
                                                    num_gqa_groups=k.shape[1],
                                                    attn_mask_type="padding_causal",
                                                    qkv_format="thd")
            cores[key].set_context_parallel_group(group, ranks, streams[device], TE_COMM[comm])
            return cores[key](q, k, v, pad_between_seqs=True, **bounds).view_as(q)
        return attend
    return for_micro_batch
