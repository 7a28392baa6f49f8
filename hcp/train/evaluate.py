"""Held-out evaluation: token-level loss and greedy-decoded answer accuracy."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from hcp.data.llava import IGNORE_INDEX
from hcp.data.packing import collate, first_fit


def _packs(samples, capacity):
    return [[samples[i] for i in idx] for idx in first_fit([len(s.input_ids) for s in samples], capacity)]


@torch.no_grad()
def evaluate(model, dataset, tokenizer, indices, capacity: int, device, loss_group=None,
             lane_group=None, max_new_tokens: int = 8) -> dict:
    """Evaluate this rank's lane's share `indices` of the held-out set.

    Loss sums are reduced over `loss_group` (DP x CP: each CP rank holds part of the tokens),
    sample counts over `lane_group` (DP).

    Returns {"eval/loss": token-level mean cross-entropy, "eval/answer_accuracy": fraction of
    samples whose greedy answer (decoded from the prompt until EOS or `max_new_tokens`) equals
    the reference answer after stripping whitespace}.
    """
    was_training = model.training
    model.eval()
    samples = [dataset[i] for i in indices]
    loss_sum = torch.zeros(3, dtype=torch.float64)  # loss, tokens, correct
    for pack in _packs(samples, capacity):
        batch = collate(pack, [dataset.pixel_values(s) for s in pack], tokenizer.image_token_id).to(device)
        loss, n = model(batch)
        loss_sum[0] += loss.item()
        loss_sum[1] += n
    if not getattr(dataset, "has_answers", False):
        return _reduce(model, was_training, loss_sum, len(samples), (loss_group, lane_group), False)
    # Greedy decoding of every sample in lock-step; no KV cache (tiny models).
    prompts = [SimpleNamespace(id=s.id, input_ids=list(s.input_ids[:s.prompt_len]),
                               labels=[IGNORE_INDEX] * s.prompt_len, src=s) for s in samples]
    generated = {p.id: [] for p in prompts}
    active = list(prompts)
    for _ in range(max_new_tokens):
        if not active:
            break
        still = []
        for pack in _packs(active, capacity + max_new_tokens):
            batch = collate(pack, [dataset.pixel_values(p.src) for p in pack],
                            tokenizer.image_token_id).to(device)
            logits = model.logits(batch)[batch.cu_seqlens[1:].long() - 1]
            for p, tok in zip(pack, logits.argmax(-1).tolist()):
                if tok == tokenizer.eos_id:
                    continue
                generated[p.id].append(tok)
                p.input_ids.append(tok)
                p.labels.append(IGNORE_INDEX)
                still.append(p)
        active = still
    for s in samples:
        loss_sum[2] += float(tokenizer.decode(generated[s.id]).strip() == s.answer.strip())
    return _reduce(model, was_training, loss_sum, len(samples), (loss_group, lane_group), True)


def _reduce(model, was_training, sums, num_samples, groups, with_accuracy) -> dict:
    total = torch.tensor([sums[0], sums[1], sums[2], num_samples], dtype=torch.float64)
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
