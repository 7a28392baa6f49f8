"""The colocated three-phase step (docs/design.md 4.4) with one or several encoders: one encoder
at its own TP/DP layout (with and without encoder recompute), a join (two encoders, each with
its own architecture, layout and projector, into one LLM) and a branch (one vision tower feeding
a per-patch projector and a pooled summary projector) run colocated on 4 forked gloo ranks
through the real step plan (`plan_step` with one length index per stream) and
`ColocatedStep.run_streams`, and equal the single-process `LlavaModel` (FP32, rtol 1e-5 / atol
1e-6): loss, every module's gradients (made whole over TP) and weights after one AdamW step. The
last edge's routes move rows bit for bit, forward and backward; under encoder recompute no
encoder activation is held across the LLM phase."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import torch.distributed as dist
# autograd.backward(outs, grads) imports this lazily (seconds per forked rank on a loaded machine)
import torch.fx.experimental.symbolic_shapes  # noqa: F401
from dist_utils import run_ranks

from hcp.comm.boundary import route_backward, route_forward
from hcp.config.layouts import ResolvedLayout
from hcp.config.modules import streams
from hcp.config.schema import LLMConfig, ProjectorConfig, VisionConfig
from hcp.model import init_parameters
from hcp.model.encoder_side import EncoderSide
from hcp.model.llava import LlavaModel
from hcp.parallel.cp_sharding import cp_shard
from hcp.parallel.groups import ProcessGroupRegistry
from hcp.plan.lengths import SampleSizes
from hcp.plan.step import plan_step
from hcp.schedule.colocated import ColocatedStep
from parity_utils import whole

SEED, B, MBT = 7, 8, 32
TOL = dict(rtol=1e-5, atol=1e-6)
ADAM = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-4, weight_decay=0.0)
# eps 1e-4: fp32 noise on a near-zero gradient would otherwise move a weight by lr * noise / eps
ENCODERS = {"vision": VisionConfig(image_size=4, patch_size=2, hidden_size=16, num_layers=2, num_heads=2,
                                   ffn_hidden_size=32),                                  # 4 patches
            "vision2": VisionConfig(image_size=8, patch_size=4, hidden_size=8, num_layers=1, num_heads=2,
                                    ffn_hidden_size=16)}                                 # 4 patches
PROJECTORS = {"projector": ProjectorConfig(), "projector2": ProjectorConfig(type="linear"),
              "pooled": ProjectorConfig(pool=2)}                                         # 1 row
LLM = LLMConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64)
TOKEN = {"projector": 60, "projector2": 61, "pooled": 62}
ROWS = {"projector": 4, "projector2": 4, "pooled": 1}
GRAPHS = {
    "single": [["vision", "projector"], ["projector", "llm"]],
    "join": [["vision", "projector"], ["projector", "llm"], ["vision2", "projector2"], ["projector2", "llm"]],
    "branch": [["vision", "projector"], ["vision", "pooled"], ["projector", "llm"], ["pooled", "llm"]],
}
CASES = {  # (graph, {module: (tp, cp, dp)} on 4 ranks, encoder recompute)
    "single__vision_dp4__llm_tp2_cp2__recompute": (
        "single", {"vision": (1, 1, 4), "projector": (1, 1, 4), "llm": (2, 2, 1)}, True),
    "single__vision_tp2_dp2__llm_cp4__recompute": (
        "single", {"vision": (2, 1, 2), "projector": (2, 1, 2), "llm": (1, 4, 1)}, True),
    "single__vision_tp2_dp2__llm_dp4_fan_out": (
        "single", {"vision": (2, 1, 2), "projector": (2, 1, 2), "llm": (1, 1, 4)}, False),
    "join__vision_tp2_dp2__vision2_dp4__llm_tp2_cp2": (
        "join", {"vision": (2, 1, 2), "projector": (2, 1, 2), "vision2": (1, 1, 4), "projector2": (1, 1, 4),
                 "llm": (2, 2, 1)}, False),
    "branch__vision_dp4__llm_tp2_dp2": (
        "branch", {"vision": (1, 1, 4), "projector": (1, 1, 4), "pooled": (1, 1, 4), "llm": (2, 1, 2)}, False),
}


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    pixel_values: torch.Tensor | None
    image_mask: torch.Tensor
    stream_masks: dict = field(default_factory=dict)
    encoder_pixels: dict = field(default_factory=dict)
    image_rows: torch.Tensor | None = None
    stream_rows: dict = field(default_factory=dict)


def make_samples(graph):
    """B samples: text of 3..10 tokens, 0-2 `vision` inputs and 0-1 `vision2` inputs (as the
    graph has them) at random places; each input expands into every stream of its encoder."""
    g = torch.Generator().manual_seed(SEED)
    flows = streams(graph)
    encoders = [e for e in ENCODERS if any(s.encoder == e for s in flows)]
    ids, inputs = [], []
    for s in range(B):
        counts = {"vision": s % 3, "vision2": (s + 1) % 2}
        seq = torch.randint(0, 50, (int(torch.randint(3, 11, (), generator=g)),), generator=g)
        mine = {}
        for e in encoders:
            c = ENCODERS[e]
            mine[e] = torch.randn(counts[e], 1, c.image_size, c.image_size, generator=g)
            for _ in range(counts[e]):
                run = torch.cat([torch.full((ROWS[f.projector],), TOKEN[f.projector]) for f in flows
                                 if f.encoder == e])
                free = [i for i in range(len(seq) + 1) if i == 0 or seq[i - 1] < 60]  # never inside a run
                at = free[int(torch.randint(0, len(free), (), generator=g))]
                seq = torch.cat([seq[:at], run, seq[at:]])
        ids.append(seq)
        inputs.append(mine)
    labels = [torch.where(x >= 60, -100, torch.randint(0, 64, x.shape, generator=g)) for x in ids]
    return flows, ids, labels, inputs


def sizes_of(flows, ids, labels):
    """(sizes of the default stream, {projector: sizes} of every stream)."""
    per = {}
    for f in flows:
        images = []
        for x in ids:
            pos = np.flatnonzero(x.numpy() == TOKEN[f.projector])
            images.append([(int(a), ROWS[f.projector]) for a in pos[::ROWS[f.projector]]])
        per[f.projector] = SampleSizes.from_lists([len(x) for x in ids], [int((y != -100).sum()) for y in labels],
                                                  images)
    return per[flows[0].projector], per


def micro_batch(samples, flows, ids, labels, inputs):
    lengths = [len(ids[s]) for s in samples]
    x = torch.cat([ids[s] for s in samples])
    encs = {f.encoder for f in flows}
    pixels = {e: torch.cat([inputs[s][e] for s in samples]) for e in encs}
    return MicroBatch(x, torch.cat([labels[s] for s in samples]), torch.cat([torch.arange(n) for n in lengths]),
                      torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32), max(lengths),
                      pixels.get("vision"), x == TOKEN["projector"],
                      {f.projector: x == TOKEN[f.projector] for f in flows if f.projector != "projector"},
                      {e: p for e, p in pixels.items() if e != "vision"})


def layouts_of(sizes: dict) -> dict:
    out = {}
    for m, (tp, cp, dp) in sizes.items():
        layers = 1 if m not in ("llm", *ENCODERS) else (LLM.num_layers if m == "llm" else ENCODERS[m].num_layers)
        out[m] = ResolvedLayout(m, tp, cp, 1, dp, 0, tp * cp * dp, (layers,), "allgather", False, "none", False)
    return out


def _configs(flows):
    encs = {e: c for e, c in ENCODERS.items() if any(f.encoder == e for f in flows)}
    return encs, {f.projector: PROJECTORS[f.projector] for f in flows}


def reference(graph):
    """Single-process loss, gradients and weights after one AdamW step."""
    flows, ids, labels, inputs = make_samples(graph)
    encs, projs = _configs(flows)
    model = LlavaModel(encs["vision"], projs["projector"], LLM,
                       encoders={e: c for e, c in encs.items() if e != "vision"},
                       projectors={p: c for p, c in projs.items() if p != "projector"}, streams=flows)
    init_parameters(model, SEED)
    total = sum(int((y != -100).sum()) for y in labels)
    loss = sum(model(micro_batch([s], flows, ids, labels, inputs))[0] for s in range(B)) / total
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), **ADAM).step()
    return float(loss.detach()), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _bitwise_last_edge(plan, rank, layouts, flows, ids, group=None):
    """Route row keys (sample * 1000 + row) over the last stream's edge: every LLM first-stage
    rank receives exactly its CP shard's rows, in slot order; the gradients come back exact."""
    f = flows[-1]
    mine = plan.rank(rank)
    route = mine.routes[(f.projector, "llm")]
    n = lambda s: int((ids[s] == TOKEN[f.projector]).sum())  # noqa: E731
    keys = [s * 1000 + k for s in mine.encoder_samples[f.projector] for k in range(n(s))]
    src = torch.tensor(keys, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
    dst = route_forward(src, route, group)
    expect = []
    for mb in mine.micro_batches:
        x = torch.cat([ids[s] for s in mb.samples]) if mb.samples else torch.zeros(0, dtype=torch.long)
        mask = x == TOKEN[f.projector]
        key = torch.cat([torch.tensor([s * 1000 + k for k in range(n(s))], dtype=torch.long)
                         for s in mb.samples]) if mb.samples else torch.zeros(0, dtype=torch.long)
        row_of = torch.cumsum(mask.long(), 0) - 1
        if mb.cp_size > 1:
            sh = cp_shard(torch.as_tensor(mb.cu_seqlens), mb.cp_size, mb.cp_rank)
            slots = (mask[sh.token_index] & sh.valid).nonzero().squeeze(1)
            expect.append(key[row_of[sh.token_index[slots]]])
        else:
            expect.append(key)
        a, b = mb.stream_rows[f.projector]
        assert b - a == len(expect[-1])
    expect = torch.cat(expect) if expect else torch.zeros(0, dtype=torch.long)
    assert torch.equal(dst[:, 0], expect.float()) and dst.shape[0] == route.dst_rows
    back = route_backward(dst, route, src.shape[0], group)
    sent = torch.zeros(src.shape[0], dtype=torch.bool)
    for row, returns in zip(route.send_index, route.grad_returns):  # a row goes to every TP rank
        sent[row] |= returns
    assert torch.equal(back[sent], src[sent]) and not back[~sent].any()
    return int(sent.sum())


def _worker(rank, world, name):
    graph, sizes, recompute = CASES[name]
    flows, ids, labels, inputs = make_samples(GRAPHS[graph])
    encs, projs = _configs(flows)
    layouts = layouts_of(sizes)
    groups = ProcessGroupRegistry(layouts)
    tp = lambda m: groups.group(m, "tp") if layouts[m].tp > 1 else None  # noqa: E731
    side = EncoderSide(encs, projs, flows, LLM.hidden_size, {e: tp(e) for e in encs})
    cp_group = groups.group("llm", "cp") if layouts["llm"].cp > 1 else None
    model = LlavaModel(encs["vision"], projs["projector"], LLM, tp_group=tp("llm"), cp_group=cp_group,
                       encoder=False, streams=flows)
    init_parameters(side, SEED)
    init_parameters(model, SEED)
    default, per_stream = sizes_of(flows, ids, labels)
    plan = plan_step(default, layouts, "first_fit", MBT, GRAPHS[graph], stream_sizes=per_stream)
    sent = _bitwise_last_edge(plan, rank, layouts, flows, ids)
    mine = plan.rank(rank)
    total = plan.counts.loss_tokens
    feed = {e: torch.cat([inputs[s][e] for s in mine.encoder_samples[e]]) for e in encs}

    saved, phase = [0], ["encoder"]

    def count(t):  # tensors saved for backward during the encoder phase
        saved[0] += phase[0] == "encoder"
        return t

    def llm_phase(leaves):
        phase[0] = "llm"
        loss = torch.zeros((), dtype=torch.float64)
        for mb in mine.micro_batches:
            if mb.empty:
                continue
            batch = micro_batch(mb.samples, flows, ids, labels, inputs)
            batch.pixel_values, batch.encoder_pixels = None, {}
            rows = {p: leaves[p][a:b] for p, (a, b) in mb.stream_rows.items()}
            batch.image_rows, batch.stream_rows = rows.pop("projector"), rows
            loss_sum, _ = model(batch)
            (loss_sum / total).backward()
            loss += loss_sum.detach().double()
        return loss

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        loss, _ = ColocatedStep(side, recompute=recompute).run_streams(
            feed, {s: r for (s, _), r in mine.routes.items()}, llm_phase)
    dist.all_reduce(loss, group=groups.group("llm", "dp_cp"))
    for m, module in [("llm", model)] + [(e, side) for e in encs]:
        params = ([p for p in model.parameters()] if m == "llm" else
                  [p for n, p in side.named_parameters() if n.split(".")[0] in (m, *side.streams_of(m))])
        for p in params:
            dist.all_reduce(p.grad, group=groups.group(m, "dp_cp"))
    group_of = {**{e: tp(e) for e in encs}, **{f.projector: tp(f.encoder) for f in flows}, "llm": tp("llm")}
    named = list(side.named_parameters()) + list(model.named_parameters())
    grads = {n: whole(p.grad, p, group_of[n.split(".")[0]]) for n, p in named}
    torch.optim.AdamW([p for _, p in named], **ADAM).step()
    weights = {n: whole(p.detach(), p, group_of[n.split(".")[0]]) for n, p in named}
    return float(loss) / total, grads, weights, sent, saved[0]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", CASES)
def test_colocated_step_equals_single_process(name):
    graph, _, recompute = CASES[name]
    ref_loss, ref_grads, ref_weights = reference(GRAPHS[graph])
    results = run_ranks(_worker, 4, name, timeout=110)
    assert sum(r[3] for r in results) > 0, "the last edge moved no rows"
    # encoder recompute: nothing saved in phase 1 (held across phase 2); without: the activations
    assert all((r[4] == 0) == recompute for r in results), [r[4] for r in results]
    for loss, grads, weights, _, _ in results:
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert set(grads) == set(ref_grads)
        for key, ref in ref_grads.items():
            assert ref.abs().sum() > 0, f"{key} got no gradient in the reference"
            torch.testing.assert_close(grads[key], ref, **TOL, msg=lambda m, key=key: f"grad {key}: {m}")
        for key, ref in ref_weights.items():
            torch.testing.assert_close(weights[key], ref, **TOL, msg=lambda m, key=key: f"weight {key}: {m}")


def test_branch_tower_runs_once_and_sums_both_consumers():
    """One vision tower feeding two projectors: one tower forward per micro-batch, and its
    gradient is the sum of what each consumer alone gives."""
    flows, ids, labels, inputs = make_samples(GRAPHS["branch"])
    encs, projs = _configs(flows)
    grads, calls = {}, []
    for keep in ("both", "projector", "pooled"):
        model = LlavaModel(encs["vision"], projs["projector"], LLM, projectors={"pooled": projs["pooled"]},
                           streams=flows)
        init_parameters(model, SEED)
        model.vision.register_forward_hook(lambda *a: calls.append(1))
        batch = micro_batch(range(B), flows, ids, labels, inputs)
        if keep != "both":  # detach the other consumer's rows: only `keep` sends gradient back
            other = getattr(model, "pooled" if keep == "projector" else "projector")
            other.register_forward_hook(lambda mod, inp, out: out.detach())
        model(batch)[0].backward()
        grads[keep] = torch.cat([p.grad.flatten() for p in model.vision.parameters()])
    assert len(calls) == 3  # once per forward, not once per stream
    torch.testing.assert_close(grads["both"], grads["projector"] + grads["pooled"], **TOL)
    assert grads["pooled"].abs().sum() > 0


def test_second_stream_positions_are_filled_by_its_own_projector():
    """A join's LLM input: the vision2 positions hold projector2's rows, the vision positions
    projector's rows (swapping the two placeholder ids changes the loss)."""
    flows, ids, labels, inputs = make_samples(GRAPHS["join"])
    encs, projs = _configs(flows)
    model = LlavaModel(encs["vision"], projs["projector"], LLM, encoders={"vision2": encs["vision2"]},
                       projectors={"projector2": projs["projector2"]}, streams=flows)
    init_parameters(model, SEED)
    batch = micro_batch(range(B), flows, ids, labels, inputs)
    embeds = model.embed(batch)
    rows2 = model.projector2(model.vision2(batch.encoder_pixels["vision2"])).reshape(-1, LLM.hidden_size)
    rows1 = model.projector(model.vision(batch.pixel_values)).reshape(-1, LLM.hidden_size)
    torch.testing.assert_close(embeds[batch.stream_masks["projector2"]], rows2, rtol=0, atol=0)
    torch.testing.assert_close(embeds[batch.image_mask], rows1, rtol=0, atol=0)
    assert rows2.shape[0] > 0 and rows1.shape[0] > 0
