"""Pipeline parallelism, recompute and sharded DP equal the single-process reference (issue 5):
loss, every gradient (gathered over TP and FSDP) and parameters after each AdamW step agree within
rtol 1e-5 / atol 1e-6 in fp32. Every layout runs the trainer's own step (`hcp.train.step`) on
forked gloo ranks with groups from the real grid (`ProcessGroupRegistry`)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from dist_utils import run_ranks
from test_model import make_batch
from test_tp_cp_parity import LLM, SEED, TOL, VISION, whole

from hcp.config.layouts import ResolvedLayout
from hcp.config.schema import ProjectorConfig
from hcp.model import LlavaModel, init_parameters
from hcp.model.stage import StageSpec
from hcp.parallel.groups import ProcessGroupRegistry
from hcp.train.step import StepRunner


def optimizer(params):
    """AdamW with eps 1e-4: see tests/test_tp_cp_parity.py::adamw_step."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4)


def build(llm, frozen=(), **kw):
    model = LlavaModel(VISION, ProjectorConfig(), llm, **kw)
    init_parameters(model, SEED)
    for name in frozen:
        if getattr(model, name, None) is not None:
            model.get_submodule(name).requires_grad_(False)
    return model


def reference(llm, iterations, frozen=()):
    """One process: per iteration (loss, grads; None where a parameter got no gradient) and the
    params after its AdamW step."""
    model = build(llm, frozen)
    opt, out = optimizer(model.parameters()), []
    for lanes in iterations:
        batches = [b for lane in lanes for b in lane]
        sums = [model(b) for b in batches]
        loss = sum(s for s, _ in sums) / sum(n for _, n in sums)
        loss.backward()
        grads = {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out.append((loss.item(), grads, {k: p.detach().clone() for k, p in model.named_parameters()}))
    return out


def layout(tp=1, cp=1, pp=1, dp=1, pp_layers=None, recompute="none", dp_shard=False):
    split = tuple(pp_layers or (2 // pp,) * pp)
    return ResolvedLayout("llm", tp, cp, pp, dp, 0, tp * cp * pp * dp, split, "allgather", False,
                          recompute, dp_shard)


def parallel(rank, world, llm, lay, iterations, ref, frozen=(), fsdp_reduce="per_micro_batch"):
    groups = ProcessGroupRegistry({"llm": lay})
    coords = groups.grids["llm"].coords(rank)
    tp_group = groups.group("llm", "tp") if lay.tp > 1 else None
    cp_group = groups.group("llm", "cp") if lay.cp > 1 else None
    stage = StageSpec.of(lay.pp_layers, coords["pp"])
    model = build(llm, frozen, tp_group=tp_group, cp_group=cp_group, stage=stage)
    if lay.dp_shard:
        from hcp.train.fsdp import shard_model
        shard_model(model, groups)
    runner = StepRunner(model, groups, torch.device("cpu"), sharded=lay.dp_shard,
                        fsdp_reduce=fsdp_reduce)
    opt = optimizer(model.parameters())
    names = set()
    for lanes, (ref_loss, ref_grads, ref_params) in zip(iterations, ref):
        loss, _, n_micro, times = runner.forward_backward(lanes[coords["dp"]] if stage.first else None)
        # under FSDP every lane runs the largest lane's count (padded with empty micro-batches)
        lane_micro = max(map(len, lanes)) if lay.dp_shard else len(lanes[coords["dp"]])
        assert n_micro == lane_micro and times.busy_s <= times.wall_s
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for name, p in model.named_parameters():
            names.add(name)
            if ref_grads[name] is None:
                assert p.grad is None, name
                continue
            torch.testing.assert_close(gathered(p.grad, p, tp_group), ref_grads[name], **TOL,
                                       msg=lambda m, name=name: f"{name}: {m}")
        opt.step()
        opt.zero_grad()
        for name, p in model.named_parameters():
            torch.testing.assert_close(gathered(p.detach(), p, tp_group), ref_params[name], **TOL,
                                       msg=lambda m, name=name: f"{name}: {m}")
    return names


def gathered(tensor, param, tp_group):
    """The whole tensor: FSDP shards (DTensors) gathered over DP x CP, then TP shards over TP."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return whole(tensor, param, tp_group)


def docs(*lengths_per_micro_batch, seed=0, images=1):
    """One lane's micro-batches with the given document lengths (`images` 4-patch images per
    document; 0: text only)."""
    return [make_batch(lengths, vocab=LLM.vocab_size, images_per_doc=images, num_patches=4,
                       image_size=4, seed=seed + i) for i, lengths in enumerate(lengths_per_micro_batch)]


THREE = [[docs([9, 5], [7], [5, 6, 8])]]
FIVE = [[docs([6], [5, 8], [11], [5, 5, 7], [7, 9], seed=10)]]
SIX_LAYERS = replace(LLM, num_layers=6)
TWO_LANES = [[docs([9, 5], [7]), docs([5, 6, 8], [12], seed=20)]]
# issue 10: lanes packing 2 and 3 micro-batches, then 3 and 1 (the short lane is padded)
UNEVEN = [[docs([9, 5], [7]), docs([5, 6, 8], [12], [6, 7], seed=20)],
          [docs([8], [6, 9], [10], seed=30), docs([7, 11], seed=40)]]
# a text-only lane beside an image lane, then a global batch without any image
TEXT_ONLY = [[docs([9, 5], [7]), docs([6, 8], [12], seed=20, images=0)],
             [docs([8, 6], seed=30, images=0), docs([7], [5], seed=40, images=0)]]
P2P_CP = replace(LLM, layout=replace(LLM.layout, cp_comm="p2p"))
CASES = {
    # id: (decoder config, layout, iterations: per iteration, per DP lane, its micro-batches[,
    #      frozen modules])
    "pp2_3_micro": (LLM, layout(pp=2), THREE),
    "pp2_5_micro": (LLM, layout(pp=2), FIVE),
    "pp2_3_then_5_micro": (LLM, layout(pp=2), THREE + FIVE),
    "pp4_uneven_1_2_2_1": (SIX_LAYERS, layout(pp=4, pp_layers=(1, 2, 2, 1)), THREE),
    "tp2_cp2_pp2_packed": (LLM, layout(tp=2, cp=2, pp=2), FIVE),
    "tp2_sequence_parallel_pp2": (replace(LLM, layout=replace(LLM.layout, sequence_parallel=True)),
                                  layout(tp=2, pp=2), FIVE),
    "dp2_cp2_dp_shard": (LLM, layout(cp=2, dp=2, dp_shard=True), TWO_LANES),
    "tp2_dp2_dp_shard": (LLM, layout(tp=2, dp=2, dp_shard=True), TWO_LANES),
    "pp2_dp2_dp_shard": (LLM, layout(pp=2, dp=2, dp_shard=True), TWO_LANES + TWO_LANES),
    "tp2_pp2_dp2_dp_shard": (LLM, layout(tp=2, pp=2, dp=2, dp_shard=True), TWO_LANES + TWO_LANES),
    "full_recompute": (replace(LLM, layout=replace(LLM.layout, recompute="full")),
                       layout(pp=2, recompute="full"), THREE),
    "dp2_cp2_dp_shard_uneven_lanes": (LLM, layout(cp=2, dp=2, dp_shard=True), UNEVEN),
    "dp2_cp2_p2p_dp_shard_uneven_lanes": (P2P_CP, layout(cp=2, dp=2, dp_shard=True), UNEVEN),
    "tp2_pp2_dp2_dp_shard_uneven_lanes": (LLM, layout(tp=2, pp=2, dp=2, dp_shard=True), UNEVEN),
    "dp2_text_only_lane": (LLM, layout(dp=2), TEXT_ONLY),
    "dp2_cp2_dp_shard_text_only_lane": (LLM, layout(cp=2, dp=2, dp_shard=True), TEXT_ONLY),
    "pp2_dp2_text_only_lane_frozen_vision": (LLM, layout(pp=2, dp=2), TEXT_ONLY, ("vision",)),
    "dp2_dp_shard_text_only_lane_frozen_vision": (LLM, layout(dp=2, dp_shard=True), TEXT_ONLY,
                                                  ("vision",)),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_single_process_reference(case):
    llm, lay, iterations, *frozen = CASES[case]
    frozen = frozen[0] if frozen else ()
    ref = reference(replace(llm, layout=replace(llm.layout, recompute="none")), iterations, frozen)
    names = run_ranks(parallel, lay.num_ranks, llm, lay, iterations, ref, frozen, timeout=80)
    assert set().union(*names) == set(ref[0][1])  # every parameter lives on some stage


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["pp2_dp2_dp_shard", "dp2_cp2_dp_shard_uneven_lanes"])
def test_fsdp_reduce_per_step_matches_single_process_reference(case):
    """`trainer.fsdp_reduce=per_step` (one reduce-scatter per step, whole gradients accumulated
    until the last backward) gives the reference's gradients too."""
    llm, lay, iterations = CASES[case]
    ref = reference(llm, iterations, ())
    run_ranks(parallel, lay.num_ranks, llm, lay, iterations, ref, (), "per_step", timeout=80)


def bf16_step(rank, world, lay, batches):
    groups = ProcessGroupRegistry({"llm": lay})
    stage = StageSpec.of(lay.pp_layers, groups.grids["llm"].coords(rank)["pp"])
    model = LlavaModel(VISION, ProjectorConfig(), LLM, stage=stage)
    init_parameters(model, SEED)
    runner = StepRunner(model, groups, torch.device("cpu"), precision="bf16")
    sent, exchange = [], runner.link.exchange
    runner.link.exchange = lambda ops: (sent.extend((kind, t.dtype) for is_send, t, _, kind in ops
                                                    if is_send), exchange(ops))
    loss, *_ = runner.forward_backward(batches if stage.first else None)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    # activations (F, stage 0 -> 1) and their gradients (B, 1 -> 0) travel in bf16
    assert sent == [("F" if stage.first else "B", torch.bfloat16)] * len(batches)
    return loss


@pytest.mark.timeout(60)
def test_bf16_keeps_fp32_master_weights_and_gradients_sends_bf16_and_a_close_loss():
    ref = reference(LLM, THREE)[0][0]
    losses = run_ranks(bf16_step, 2, layout(pp=2), THREE[0][0], timeout=50)
    assert all(torch.isfinite(torch.tensor(x)) and x == pytest.approx(ref, rel=2e-2) for x in losses)


def test_model_flops_count_three_forwards_of_matmuls_attention_and_head():
    from hcp.train.throughput import model_flops

    h, f, v, layers = LLM.hidden_size, LLM.ffn_hidden_size, LLM.vocab_size, LLM.num_layers
    kv = h * LLM.num_kv_heads // LLM.num_heads
    per_layer = 2 * 10 * (2 * h * h + 2 * h * kv + 3 * h * f) + 2 * h * (36 + 16)
    assert model_flops(LLM, 10, 36 + 16) == 3 * (layers * per_layer + 2 * 10 * h * v)
