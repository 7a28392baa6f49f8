"""The colocated three-phase schedule (docs/design.md 4.4) against the single-process LLaVA: the
encoder at its own TP/DP layout, its rows routed to the LLM's TP x CP x DP shards, one step of
gradients equal to the single-process model's (rtol 1e-5 / atol 1e-6, fp32), with and without
encoder recompute. Routes are hand-built (tests/route_utils.py), the LLM phase is plain
gradient accumulation over the lane's micro-batches (the trainer gives the real 1F1B)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from route_utils import Batch as Rows
from route_utils import Layout, image_route, lane, micro_batches

from hcp.config.schema import LLMConfig, ProjectorConfig, VisionConfig
from hcp.model import init_parameters
from hcp.model.llava import LlavaEncoder, LlavaModel
from hcp.parallel.routing import build_routes
from hcp.schedule.colocated import ColocatedStep
from parity_utils import whole

SEED = 5
TOL = dict(rtol=1e-5, atol=1e-6)
VISION = VisionConfig(image_size=4, patch_size=2, hidden_size=16, num_layers=2, num_heads=2,
                      ffn_hidden_size=32)
PATCHES = 4
LLM = LLMConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                ffn_hidden_size=64)


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    pixel_values: torch.Tensor | None
    image_mask: torch.Tensor | None
    image_rows: torch.Tensor | None = None


@dataclass
class Samples:
    """A global batch: per sample its tokens, labels (image positions -100) and images."""

    ids: list[torch.Tensor]
    labels: list[torch.Tensor]
    mask: list[torch.Tensor]
    images: list[torch.Tensor]

    @property
    def rows(self) -> Rows:
        return Rows([len(i) for i in self.ids], [m.nonzero().squeeze(1).numpy() for m in self.mask])

    def pixels(self, samples) -> torch.Tensor:
        return torch.cat([self.images[s] for s in samples] or [torch.zeros(0, 1, 4, 4)])

    def micro_batch(self, samples) -> MicroBatch:
        lengths = [len(self.ids[s]) for s in samples]
        cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
        return MicroBatch(torch.cat([self.ids[s] for s in samples]),
                          torch.cat([self.labels[s] for s in samples]),
                          torch.cat([torch.arange(n) for n in lengths]), cu, max(lengths),
                          self.pixels(samples), torch.cat([self.mask[s] for s in samples]))


def make_samples(n: int, seed: int) -> Samples:
    """Samples with 0, 1 or 2 images (4 rows each) at random places among 3..12 text tokens."""
    g = torch.Generator().manual_seed(seed)
    out = Samples([], [], [], [])
    for s in range(n):
        images = [0, 1, 2][s % 3]
        text = int(torch.randint(3, 13, (), generator=g))
        mask = torch.zeros(text, dtype=torch.bool)
        for _ in range(images):  # an image block at a random token boundary
            at = int(torch.randint(0, len(mask) + 1, (), generator=g))
            mask = torch.cat([mask[:at], torch.ones(PATCHES, dtype=torch.bool), mask[at:]])
        labels = torch.randint(0, LLM.vocab_size, (len(mask),), generator=g)
        labels[mask] = -100
        out.ids.append(torch.randint(0, LLM.vocab_size, (len(mask),), generator=g))
        out.labels.append(labels)
        out.mask.append(mask)
        out.images.append(torch.randn(images, 1, 4, 4, generator=g))
    return out


def reference(samples: Samples, llm: Layout, num_micro: int):
    """Single-process LLaVA over every lane's micro-batches: (loss, grads by FQN)."""
    model = LlavaModel(VISION, ProjectorConfig(), LLM)
    init_parameters(model, SEED)
    n = len(samples.ids)
    batches = [samples.micro_batch(mb) for d in range(llm.dp)
               for mb in micro_batches(lane(n, llm.dp, d), num_micro)]
    total = sum(int((b.labels != -100).sum()) for b in batches)
    loss = sum(model(b)[0] for b in batches) / total
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _groups(rank, world, tp):
    """This rank's (TP group, group of the ranks sharing its TP index)."""
    mine = {}
    for name, lists in (("tp", [list(range(g, g + tp)) for g in range(0, world, tp)]),
                        ("rest", [list(range(t, world, tp)) for t in range(tp)])):
        for members in lists:
            group = dist.new_group(members)
            if rank in members:
                mine[name] = group
    return mine["tp"], mine["rest"]


def _colocated_worker(rank, world, enc, llm, num_micro, recompute, samples):
    n = len(samples.ids)
    enc_tp, enc_dp = _groups(rank, world, enc.tp)
    llm_tp, llm_rest = _groups(rank, world, llm.tp)
    cp_lists = [[b + c * llm.tp + t for c in range(llm.cp)]
                for b in range(0, world, llm.tp * llm.cp) for t in range(llm.tp)]
    cp_group = [g for g, members in ((dist.new_group(m), m) for m in cp_lists) if rank in members][0]
    encoder = LlavaEncoder(VISION, ProjectorConfig(), LLM.hidden_size, tp_group=enc_tp)
    model = LlavaModel(VISION, ProjectorConfig(), LLM, tp_group=llm_tp, cp_group=cp_group,
                       encoder=False)
    init_parameters(encoder, SEED)
    init_parameters(model, SEED)
    assert model.vision is None and model.projector is None

    inputs = image_route(samples.rows, enc, llm, num_micro)
    route = build_routes(inputs.src_keys, inputs.dst_keys, inputs.grad_owner, ranks=[rank])[rank]
    _, _, dp_i, _ = llm.coords(rank)
    mbs = micro_batches(lane(n, llm.dp, dp_i), num_micro)
    total = sum(int((lab != -100).sum()) for lab in samples.labels)
    saved = {"encoder": 0, "llm": 0}
    phase = ["encoder"]

    def llm_phase(leaf):
        phase[0] = "llm"
        loss = torch.zeros(())
        for mb, (a, b) in zip(mbs, inputs.mb_rows[rank]):
            batch = samples.micro_batch(mb)
            batch.image_rows = leaf[a:b]
            loss_sum, _ = model(batch)
            (loss_sum / total).backward()
            loss += loss_sum.detach()
        phase[0] = "after"
        return loss

    def pack(t):
        saved[phase[0]] = saved.get(phase[0], 0) + 1
        return t

    step = ColocatedStep(encoder, None, recompute)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, times = step.run(samples.pixels(lane(n, enc.dp, enc.coords(rank)[2])), route, llm_phase)
    enc_grad_nonzero = all(p.grad is not None and bool(p.grad.abs().sum() > 0)
                           for p in encoder.parameters() if p.dim() > 1)
    dist.all_reduce(loss)
    grads = {}
    for module, tp_group, rest in ((encoder, enc_tp, enc_dp), (model, llm_tp, llm_rest)):
        for name, p in module.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=rest)
            grads[name] = whole(grad, p, tp_group)
    return dict(loss=loss / total, grads=grads if rank == 0 else None,
                saved_in_phase1=saved["encoder"], enc_grad_nonzero=enc_grad_nonzero,
                busy=times.busy)


CASES = {
    # name: (encoder layout, LLM layout, micro-batches per lane, encoder recompute)
    "enc_dp4__llm_tp2_cp2": (Layout(dp=4), Layout(tp=2, cp=2), 2, False),
    "enc_dp4__llm_tp2_cp2__recompute": (Layout(dp=4), Layout(tp=2, cp=2), 2, True),
    "enc_tp2_dp2__llm_cp4__recompute": (Layout(tp=2, dp=2), Layout(cp=4), 2, True),
    "enc_tp2_dp2__llm_dp4_fan_out": (Layout(tp=2, dp=2), Layout(dp=4), 1, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_colocated_step_gradients_equal_single_process(name):
    enc, llm, num_micro, recompute = CASES[name]
    samples = make_samples(8, seed=11)
    ref_loss, ref_grads = reference(samples, llm, num_micro)
    out = run_ranks(_colocated_worker, 4, enc, llm, num_micro, recompute, samples, timeout=120)
    # the loss is summed over every rank: each TP replica counts its shard once per TP rank
    torch.testing.assert_close(out[0]["loss"] / llm.tp, ref_loss, **TOL)
    assert set(out[0]["grads"]) == set(ref_grads)
    for key, grad in out[0]["grads"].items():
        torch.testing.assert_close(grad, ref_grads[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")
    assert all(o["enc_grad_nonzero"] for o in out), "an encoder rank got no gradient"
    if recompute:
        assert all(o["saved_in_phase1"] == 0 for o in out), "encoder activations held in phase 2"
    else:
        assert all(o["saved_in_phase1"] > 0 for o in out)
