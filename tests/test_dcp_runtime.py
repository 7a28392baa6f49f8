"""Dynamic CP at the unit level on forked gloo ranks: each rank runs its step-plan micro-batches
of the tiny LLaMA, each with its CP group taken from the pre-built dynamic-CP groups; the
token-level loss and every gradient match the single-process FP32 reference (rtol 1e-5)."""
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_ranks
from hcp.config.compose import compose_config
from hcp.dcp.policy import dynamic_cp_policy, micro_batch_group
from hcp.model.init import init_parameters
from hcp.model.llama import LlamaDecoder
from hcp.parallel.cp_sharding import cp_shard
from hcp.plan.lengths import SampleSizes
from hcp.plan.step import plan_step, register_policy

CFG = compose_config(["+recipe=llama_tiny"])


def lay(dp, tp=1):
    return NS(module="llm", tp=tp, cp=1, pp=1, dp=dp, rank_offset=0, num_ranks=tp * dp,
              pp_layers=(CFG.llm.num_layers,), recompute="none", dp_shard=False,
              cp_comm="allgather", sequence_parallel=False)


def batch(seed, n):
    rng = np.random.default_rng(seed)
    lens = np.r_[rng.integers(3, 40, n - 2), [150, 230]]  # the long ones need CP at cap 64
    docs = [torch.tensor(rng.integers(0, CFG.llm.vocab_size, int(L))) for L in lens]
    return lens, docs


def labels_of(doc):
    return torch.cat([doc[1:], torch.tensor([-100])])


def model():
    m = LlamaDecoder(CFG.llm)
    init_parameters(m, 7, prefix="llm.")
    return m


def loss_sum(m, ids, labels, pos, cu, max_seqlen, group):
    h = m.exit(m.run_layers(m.enter(m.embed(ids)), pos, cu, max_seqlen, cp_group=group),
               ids.shape[0])
    return F.cross_entropy(m.logits(h).float(), labels, ignore_index=-100, reduction="sum")


def reference(lens, docs):
    m = model()
    ids = torch.cat(docs)
    labels = torch.cat([labels_of(d) for d in docs])
    pos = torch.cat([torch.arange(len(d)) for d in docs])
    cu = torch.tensor(np.r_[0, np.cumsum(lens)], dtype=torch.int32)
    total = int(sum(L - 1 for L in lens))
    loss = loss_sum(m, ids, labels, pos, cu, int(max(lens)), None) / total
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in m.named_parameters()}


def _rank(rank, world, lens, docs, cap):
    import torch.distributed as dist

    from hcp.parallel.groups import ProcessGroupRegistry

    register_policy("dynamic_cp", dynamic_cp_policy(CFG.llm))
    sizes = SampleSizes.from_lists(list(lens), [int(L) - 1 for L in lens], [[] for _ in lens])
    layouts = {"llm": lay(world)}
    groups = ProcessGroupRegistry(layouts, dynamic_cp_modules=("llm",))

    def refuse(*args, **kwargs):
        raise AssertionError("a process group was created during the step")

    dist.new_group = refuse  # every micro-batch's CP group must be a pre-built one (forked rank)
    plan = plan_step(sizes, layouts, "dynamic_cp", cap).rank(rank)
    m = model()
    total = int(sum(L - 1 for L in lens))
    loss = torch.zeros(1, dtype=torch.float64)
    used = set()
    for mb in plan.micro_batches:
        if mb.empty:
            continue
        group = micro_batch_group(groups, mb, rank)
        used.add(mb.cp_size)
        ids = torch.cat([docs[s] for s in mb.samples])
        labels = torch.cat([labels_of(docs[s]) for s in mb.samples])
        cu = torch.from_numpy(mb.cu_seqlens)
        if mb.cp_size > 1:
            sh = cp_shard(cu, mb.cp_size, mb.cp_rank)
            ids, pos = ids[sh.token_index], sh.position_ids
            labels = labels[sh.token_index].masked_fill(~sh.valid, -100)
        else:
            pos = torch.cat([torch.arange(len(docs[s])) for s in mb.samples])
        assert ids.shape[0] == mb.local_tokens <= cap  # the plan's count of this rank's slots
        part = loss_sum(m, ids, labels, pos, cu, mb.max_seqlen, group) / total
        part.backward()
        loss += part.item()
    for p in m.parameters():  # plain DP sync over the pool (ranks of empty micro-batches too)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    dist.all_reduce(loss)
    sizes_seen = [None] * world
    dist.all_gather_object(sizes_seen, sorted(used))
    return loss.item(), {k: p.grad for k, p in m.named_parameters()}, sizes_seen


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_dynamic_cp_matches_the_single_process_reference(world):
    lens, docs = batch(world, 24)
    ref_loss, ref_grads = reference(lens, docs)
    out = run_ranks(_rank, world, lens, docs, 64, timeout=300)
    loss, grads, seen = out[0]
    assert max(max(s, default=1) for s in seen) >= 4  # the long documents ran under CP >= 4
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-5, atol=1e-6)
