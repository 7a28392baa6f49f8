"""Every rank of a collective runs the same number of collectives, whatever the data (issue 10
part 1): DP lanes with fewer micro-batches, fewer held-out samples or none, prompts that finish
decoding at different steps, and text-only lanes beside image lanes. The single-process
results are the reference; under FSDP (`dp_shard`) every forward and backward all-gathers over
DP x CP, so any mismatch would hang or fail on gloo."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from dist_utils import run_ranks
from test_pipeline_parity import build, layout
from test_tp_cp_parity import LLM

from hcp.data.packing import collate
from hcp.train.evaluate import evaluate

IMAGE_TOKEN, PATCHES, CAPACITY = 63, 4, 24


@dataclass
class Sample:
    id: str
    input_ids: list
    labels: list
    prompt_len: int
    answer: str = ""
    images: int = 0
    image_files: list = field(default_factory=list)


class HeldOut:
    """Six prompts (every other one with an image) of 3..10 tokens plus a 3-token answer."""

    has_answers = True

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.samples = []
        for i in range(6):
            images = i % 2
            prompt = [IMAGE_TOKEN] * (PATCHES * images) + torch.randint(
                0, 60, (3 + i,), generator=g).tolist()
            answer = torch.randint(0, 60, (3,), generator=g).tolist()
            ids = prompt + answer
            labels = [-100] * (len(prompt) - 1) + answer + [-100]
            self.samples.append(Sample(f"s{i}", ids, labels, len(prompt), images=images))

    def __getitem__(self, i):
        return self.samples[i]

    def __len__(self):
        return len(self.samples)

    def pixel_values(self, s):
        g = torch.Generator().manual_seed(int(s.id[1:]))
        return torch.randn(s.images, 1, 4, 4, generator=g)


class Tok:
    image_token_id = IMAGE_TOKEN

    def __init__(self, eos_id):
        self.eos_id = eos_id

    def decode(self, ids):
        return " ".join(map(str, ids))


def one_process_run(model):
    return lambda batches, head: [head(b, model.stage_forward(b)) for b in batches]


def held_out_with_answers():
    """EOS is the first greedy token of sample 0: the prompts that start with it finish at
    once with an empty answer (correct), the others decode until `max_new_tokens` (their
    answer "wrong" never matches), and the lane holding no sample finishes before any."""
    model, ds = build(LLM), HeldOut()
    with torch.no_grad():
        prompts = [Sample(s.id, s.input_ids[:s.prompt_len], [-100] * s.prompt_len, s.prompt_len)
                   for s in ds.samples]
        first = [int(model.logits(collate([p], [ds.pixel_values(s)], IMAGE_TOKEN))[-1].argmax())
                 for p, s in zip(prompts, ds.samples)]
    for s, tok in zip(ds.samples, first):
        s.answer = "" if tok == first[0] else "wrong"
    return ds, Tok(first[0])


def lane_eval(rank, world, lay, ds, tok):
    from hcp.model.stage import StageSpec
    from hcp.parallel.groups import ProcessGroupRegistry
    from hcp.train.fsdp import shard_model
    from hcp.train.step import StepRunner

    groups = ProcessGroupRegistry({"llm": lay})
    coords = groups.grids["llm"].coords(rank)
    model = build(LLM, stage=StageSpec.of(lay.pp_layers, coords["pp"]))
    shard_model(model, groups)
    runner = StepRunner(model, groups, torch.device("cpu"), sharded=True)
    per = -(-len(ds) // lay.dp)  # the trainer's split: 6 samples at dp4 -> 2, 2, 2, 0
    indices = list(range(coords["dp"] * per, min(len(ds), (coords["dp"] + 1) * per)))
    return evaluate(model, runner.forward_outputs, ds, tok, indices, CAPACITY, torch.device("cpu"),
                    groups.group("llm", "dp_cp"), groups.group("llm", "dp"))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("lay", [layout(dp=4, dp_shard=True), layout(pp=2, dp=2, dp_shard=True)],
                         ids=["dp4_dp_shard", "pp2_dp2_dp_shard"])
def test_greedy_eval_with_uneven_and_empty_lanes_matches_one_process(lay):
    ds, tok = held_out_with_answers()
    model = build(LLM)
    ref = evaluate(model, one_process_run(model), ds, tok, range(len(ds)), CAPACITY,
                   torch.device("cpu"))
    assert 0 < ref["eval/answer_accuracy"] < 1 and ref["eval/samples"] == 6
    for out in run_ranks(lane_eval, lay.num_ranks, lay, ds, tok, timeout=80):
        assert out["eval/samples"] == 6
        assert out["eval/answer_accuracy"] == ref["eval/answer_accuracy"]
        assert out["eval/loss"] == pytest.approx(ref["eval/loss"], rel=1e-5)
