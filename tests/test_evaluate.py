"""Greedy answer accuracy decodes as far as the data needs: by default up to the longest
reference answer of the held-out set plus its EOS (`trainer.eval_max_new_tokens=null`), so a
model that answers every prompt exactly scores 1 whatever the answers' length (a fixed cap of
8 tokens scored every answer longer than 7 tokens 0), and a model that goes on past the
answer scores 0. Real LLaVA-JSON records and the byte tokenizer; the model is an oracle that
reads the reference sequence."""
import json

import pytest
import torch

from hcp.config.errors import ConfigError
from hcp.data.llava import LlavaDataset
from hcp.data.tokenizer import ByteTokenizer
from hcp.train.evaluate import answer_tokens, evaluate

ANSWERS = ["7", "a b c", "the quick brown fox jumps", "x" * 40]   # 1 to 40 bytes


class Oracle:
    """Predicts each position's next token from the held-out sample its prefix belongs to;
    `!` past the reference (or off it), and instead of its EOS when `stops=False`."""

    def __init__(self, dataset, tok, stops=True):
        self.seqs, self.tok, self.stops = [s.input_ids for s in dataset.samples], tok, stops
        self.training = False

    def eval(self):
        self.training = False

    def train(self, mode=True):
        self.training = mode

    def loss(self, batch, hidden):
        return torch.tensor(0.0), torch.tensor(1.0)

    def logits(self, batch, hidden):
        out = torch.full((len(batch.input_ids), self.tok.vocab_size), -1.0)
        cu = batch.cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            doc = batch.input_ids[a:b].tolist()
            for t in range(len(doc)):
                ref = next((s for s in self.seqs if s[:t + 1] == doc[:t + 1]), [])
                nxt = ref[t + 1] if t + 1 < len(ref) else ord("!")
                out[a + t, ord("!") if nxt == self.tok.eos_id and not self.stops else nxt] = 1.0
        return out


@pytest.fixture
def held_out(tmp_path):
    records = [{"id": f"s{i}", "conversations": [{"from": "human", "value": f"question {i}?"},
                                                 {"from": "gpt", "value": a}]}
               for i, a in enumerate(ANSWERS)]
    (tmp_path / "eval.json").write_text(json.dumps(records))
    tok = ByteTokenizer()
    return LlavaDataset(str(tmp_path / "eval.json"), str(tmp_path), tok, 4, 8, 1, 256), tok


def _accuracy(dataset, tok, model, **kw):
    run = lambda batches, head: [head(b, None) for b in batches]  # noqa: E731 (one process)
    return evaluate(model, run, dataset, tok, range(len(dataset)), 256, torch.device("cpu"),
                    **kw)["eval/answer_accuracy"]


def test_answer_tokens_are_the_trained_answer_plus_eos(held_out):
    ds, tok = held_out
    # The Vicuna template trains " " + answer, then EOS.
    assert [answer_tokens(s, tok.eos_id) for s in ds.samples] == [len(a) + 2 for a in ANSWERS]


def test_long_answers_are_decoded_whole_and_a_model_that_never_stops_scores_zero(held_out):
    ds, tok = held_out
    assert _accuracy(ds, tok, Oracle(ds, tok)) == 1.0                      # 40-byte answer included
    assert _accuracy(ds, tok, Oracle(ds, tok), max_new_tokens=8) == 0.5    # the old cap: 2 of 4
    assert _accuracy(ds, tok, Oracle(ds, tok, stops=False)) == 0.0         # answer + more: wrong


def test_eval_max_new_tokens_is_checked_before_ranks_start():
    from cfg_utils import compose_cfg
    from hcp.config.validate import validate

    cfg = compose_cfg(["+recipe=llama_tiny", "trainer.eval_max_new_tokens=0"])
    with pytest.raises(ConfigError, match=r"trainer.eval_max_new_tokens=0: .* Fix: use null"):
        validate(cfg, world_size=4)
    validate(compose_cfg(["+recipe=llama_tiny", "trainer.eval_max_new_tokens=64"]), world_size=4)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_static_cp_evaluates_samples_longer_than_one_ranks_cap(tmp_path):
    """llm.layout.cp=4 with trainer.micro_batch_tokens=128 per rank trains 512-token samples
    (capacity 128 x 4); evaluation packs with the same capacity (it crashed on the per-rank cap)
    and gives one process's held-out loss at 512 tokens."""
    from cfg_utils import cli_run, run_summary

    common = ["trainer.max_steps=1", "trainer.eval_samples=8", "data.max_seq_len=512"]
    cp4 = run_summary(cli_run(tmp_path / "cp4", "llama_tiny", [*common, "llm.layout.cp=4",
                                                                "trainer.micro_batch_tokens=128"]))
    one = run_summary(cli_run(tmp_path / "one", "llama_tiny", [*common, "launcher.nproc_per_node=1",
                                                                "trainer.micro_batch_tokens=512"]))
    assert cp4["final_loss"] == pytest.approx(one["final_loss"], rel=1e-4)
    assert cp4["eval/loss"] == pytest.approx(one["eval/loss"], rel=1e-4)
