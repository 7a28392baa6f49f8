"""Held-out evaluation: token-level loss and greedy-decoded answer accuracy.

Micro-batches run through `run(batches, head)` (the trainer's `StepRunner.forward_outputs`):
under PP the last stage's `head` result reaches every stage, so the first stage can extend the
prompts. Every stage and DP lane runs in lock-step whatever its data: lanes with fewer
micro-batches are padded with `empty_batch`es, and greedy decoding goes on until every lane is
done (one all-reduce of the active count per token). Under `packing=dynamic_cp` evaluation keeps
the static layout with the trainer's raised capacity (`eval_capacity`), so its collectives are
first_fit's and its loss equals first_fit's for the same weights."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from hcp.data.llava import IGNORE_INDEX
from hcp.data.packing import collate, first_fit, pad_micro_batches


def _packs(samples, capacity):
    return [[samples[i] for i in idx]
            for idx in first_fit([len(s.input_ids) for s in samples], capacity)]


def answer_tokens(sample, eos_id: int) -> int:
    """Greedy steps `sample`'s reference answer takes: its first answer's tokens as trained (from
    `prompt_len` to the first `eos_id`) plus one for the EOS, so that decoding can show it stops
    there (a model that goes on past the answer then scores wrong). A sample with no EOS after
    its prompt counts every token after the prompt, plus one."""
    answer = list(sample.input_ids[sample.prompt_len:])
    return (answer.index(eos_id) if eos_id in answer else len(answer)) + 1


def eval_capacity(packing, llm_cp: int) -> int:
    """Tokens per evaluation micro-batch: training's, `packing.micro_batch_tokens` per rank
    times the LLM's CP size `llm_cp` (`packing`: `hcp.config.settings.PackingSpec`). Evaluation
    keeps the static layout; under dynamic CP a sample that training spreads over a larger CP
    group is evaluated whole on its DP lane, forward only (no activations kept for a backward
    pass), so the capacity is raised to `packing.max_seq_len` there."""
    cap = packing.micro_batch_tokens * llm_cp
    return max(cap, packing.max_seq_len) if packing.dynamic_cp else cap


@torch.no_grad()
def evaluate(model, run, dataset, tokenizer, indices, capacity: int, device, loss_group=None,
             lane_group=None, max_new_tokens: int | None = None) -> dict:
    """Evaluate this rank's lane's share `indices` of the held-out set with `run` (see the
    module docstring); `model` is this rank's stage (`LlavaModel`).

    Loss sums are reduced over `loss_group` (DP x CP: each CP rank holds part of the tokens),
    sample counts over `lane_group` (DP), which also keeps the lanes in lock-step (module
    docstring); `indices` may be empty.

    Returns {"eval/loss": token-level mean cross-entropy, "eval/answer_accuracy": fraction of
    samples whose greedy answer (decoded from the prompt until EOS or `max_new_tokens`) equals
    the reference answer after stripping whitespace}. `max_new_tokens` None (the default of
    `trainer.eval_max_new_tokens`): the longest reference answer of the evaluated samples, EOS
    included (`answer_tokens`, the maximum over every lane, so all lanes decode in lock-step).
    """
    was_training = model.training
    model.eval()

    def lane_max(n: int) -> int:
        count = torch.tensor([n], dtype=torch.long, device=device)
        if dist.is_initialized() and lane_group is not None:
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=lane_group)
        return int(count)

    def lockstep(batches, head) -> list:
        """`run` over as many micro-batches as the fullest lane; this lane's outputs."""
        return run(pad_micro_batches(batches, lane_max(len(batches)), device), head)[:len(batches)]

    samples = [dataset[i] for i in indices]
    loss_sum = torch.zeros(3, dtype=torch.float64)  # loss, tokens, correct
    batches = [_collate(dataset, tokenizer, pack, pack).to(device)
               for pack in _packs(samples, capacity)]
    for out in lockstep(batches, lambda b, h: torch.tensor([float(t) for t in model.loss(b, h)],
                                                          dtype=torch.float64, device=device)):
        loss_sum[0] += float(out[0])
        loss_sum[1] += float(out[1])
    if not getattr(dataset, "has_answers", False):
        return _reduce(model, was_training, loss_sum, len(samples), (loss_group, lane_group), False,
                       device)
    # Greedy decoding of every sample in lock-step; no KV cache (tiny models).
    if max_new_tokens is None:
        max_new_tokens = lane_max(max((answer_tokens(s, tokenizer.eos_id) for s in samples),
                                      default=0))
    prompts = [SimpleNamespace(id=s.id, input_ids=list(s.input_ids[:s.prompt_len]),
                               labels=[IGNORE_INDEX] * s.prompt_len, src=s) for s in samples]
    generated = {p.id: [] for p in prompts}
    active = list(prompts)
    for _ in range(max_new_tokens):
        if lane_max(len(active)) == 0:  # every lane is done
            break
        still = []
        packs = _packs(active, capacity + max_new_tokens)
        batches = [_collate(dataset, tokenizer, pack, [p.src for p in pack]).to(device)
                   for pack in packs]
        next_tokens = lockstep(batches, lambda b, h: model.logits(b, h)[b.cu_seqlens[1:].long() - 1]
                               .argmax(-1))
        for pack, toks in zip(packs, next_tokens):
            for p, tok in zip(pack, [int(t) for t in toks.tolist()]):
                if tok == tokenizer.eos_id:
                    continue
                generated[p.id].append(tok)
                p.input_ids.append(tok)
                p.labels.append(IGNORE_INDEX)
                still.append(p)
        active = still
    for s in samples:
        loss_sum[2] += float(tokenizer.decode(generated[s.id]).strip() == s.answer.strip())
    return _reduce(model, was_training, loss_sum, len(samples), (loss_group, lane_group), True,
                   device)


def _collate(dataset, tokenizer, pack, sources):
    """One evaluation micro-batch of `pack` with the inputs of `sources` (a LLaVA data set:
    every encoder's inputs and every stream's mask, `LlavaDataset.collate`; h-encoders)."""
    if hasattr(dataset, "collate"):
        return dataset.collate(pack, sources)
    return collate(pack, [dataset.pixel_values(s) for s in sources], tokenizer.image_token_id)


def _reduce(model, was_training, sums, num_samples, groups, with_accuracy, device) -> dict:
    """Sum (loss, tokens) over groups[0] and (correct, samples) over groups[1] (on `device`:
    NCCL reduces only CUDA tensors)."""
    total = torch.tensor([sums[0], sums[1], sums[2], num_samples], dtype=torch.float64,
                         device=device)
    if dist.is_initialized():
        loss_part, count_part = total[:2].clone(), total[2:].clone()
        dist.all_reduce(loss_part, group=groups[0])
        dist.all_reduce(count_part, group=groups[1])
        total = torch.cat([loss_part, count_part])
    model.train(was_training)
    out = {"eval/loss": (total[0] / total[1].clamp(min=1)).item(), "eval/samples": int(total[3])}
    if with_accuracy:
        out["eval/answer_accuracy"] = (total[2] / total[3].clamp(min=1)).item()
    return out
